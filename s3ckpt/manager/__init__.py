"""`CheckpointManager`: step-numbered checkpoints of a training run, saved in the background,
thinned out by a retention policy, and restored from the newest one that loads.

The product's front door, above the DCP adapters and the tools it uses (`tools.removal` for
retention's deletes, `tools.verify` for restore's checks, the pure `tools.retention` policy,
shared with ``s3ckpt prune``). It may import everything below it (`tools`, `dcp`, `format`,
`engine`, the foundation); nothing in s3ckpt imports it but the public names.

The modules: `checkpoints` (the manager), `policy` (`SavePolicy`: when and how it saves),
`steps` (a run's committed steps, retention's deletes), `restore` (the fallback and the read
lease), `states` (modules and optimizers as DCP Statefuls), `collective` (how ranks agree).
"""

from .checkpoints import CheckpointManager
from .policy import SavePolicy

__all__ = ["CheckpointManager", "SavePolicy"]
