"""The training process: a small causal LM on Python's help texts, checkpointed by a
`CheckpointManager`.

It runs as ``python -m s3ckpt.tools.demo --child train --url s3://bucket/run ...`` so that the
demo can SIGKILL it. On start it restores the newest committed checkpoint under the URL, if there
is one. It reports every step, save and resume as one JSON line on stdout (`Events`); the parent
reads them to time the run, to know when an upload is under way, and to compare loss curves.

Exact continuation needs everything a step depends on in the checkpoint: the model, the optimizer
(moments and step counts), the data order (the batch generator's state) and the global RNG, plus
the same arithmetic, hence one thread and deterministic algorithms. The state passes them as they
are: the manager takes the model's and the optimizer's state at each save and sets them after a
restore, and `Batches` and `GlobalRng` are DCP ``Stateful`` objects, asked for their state when a
save starts and handed it back after a load.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
import warnings
from concurrent.futures import Future
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from ... import CheckpointManager
from ...engine import bridge
from ...engine.contract import ObjectStore
from ...engine.store import get_store
from ...format.layout import Location, step_name

__all__ = ["Batches", "GlobalRng", "TinyLM", "corpus", "train"]

CONTEXT = 64
SEED = 0
_POLL_S = 0.01


class TinyLM(nn.Module):
    """A character-level causal transformer: 3.2 M parameters, 39 MB of state with AdamW."""

    def __init__(self, vocab: int, width: int = 256, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(CONTEXT, width))
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(CONTEXT))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        logits: torch.Tensor = self.head(self.blocks(x, mask=self.mask, is_causal=True))
        return logits


def corpus() -> tuple[torch.Tensor, int]:
    """Python's own help topics (about 0.5 MB of English, shipped with every Python) as character
    ids, and the vocabulary size."""
    from pydoc_data.topics import topics

    text = "".join(topics[name] for name in sorted(topics))
    index = {char: i for i, char in enumerate(sorted(set(text)))}
    return torch.tensor([index[char] for char in text]), len(index)


class Batches:
    """Random windows of the corpus. Its state goes into every checkpoint, so that a resumed run
    draws exactly the batches the uninterrupted one draws."""

    def __init__(self, data: torch.Tensor, batch: int) -> None:
        self.data = data
        self.batch = batch
        self.generator = torch.Generator().manual_seed(SEED)
        self.drawn = 0

    def __next__(self) -> torch.Tensor:
        starts = torch.randint(
            0, len(self.data) - CONTEXT - 1, (self.batch,), generator=self.generator
        )
        self.drawn += 1
        return torch.stack([self.data[s : s + CONTEXT + 1] for s in starts.tolist()])

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state(), "drawn": self.drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.drawn = state["drawn"]


class Events:
    """One JSON line per event on stdout, whole even when the save's thread reports."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __call__(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, "t": time.time(), **fields})
        with self._lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()


class GlobalRng(Stateful):
    """torch's global generator, which dropout and initialisation draw from."""

    def state_dict(self) -> dict[str, Any]:
        return {"state": torch.get_rng_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict["state"])


def state_bytes(state: Any) -> int:
    """Bytes of the tensors in ``state``: what a save has to move, before any compression."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, nn.Module | torch.optim.Optimizer | Stateful):
        return state_bytes(state.state_dict())
    if isinstance(state, dict):
        return sum(state_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(value) for value in state)
    return 0


class Commits:
    """When each background save commits, for the demo's timeline (instrumentation, not part of
    a training loop): the manager tells no one, so a task on s3ckpt's loop HEADs the step's
    ``.metadata`` every `_POLL_S` until it is there."""

    def __init__(self, url: str, emit: Events) -> None:
        self.run = Location.of(url)
        self.store: ObjectStore = get_store()
        self.emit = emit
        self.watching: list[Future[None]] = []

    def watch(self, step: int) -> None:
        at = Location(self.run.bucket, self.run.key(step_name(step)))
        self.watching.append(bridge.submit(self._until_committed(at, step)))

    async def _until_committed(self, at: Location, step: int) -> None:
        while await self.store.head(at.bucket, at.metadata_key) is None:
            await asyncio.sleep(_POLL_S)
        self.emit("saved", step=step)

    def wait(self) -> None:
        """Once the manager has waited for its saves, each watch ends at its next HEAD."""
        for watching in self.watching:
            watching.result()


def train(url: str, steps: int, every: int, batch: int, keep_last: int) -> None:
    """Train to ``steps``: a checkpoint ``url/step-<step>`` every ``every`` steps, of which the
    manager keeps the newest ``keep_last``."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(SEED)
    emit = Events()
    commits = Commits(url, emit)
    data, vocab = corpus()
    model = TinyLM(vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = Batches(data, batch)
    state = {"model": model, "optim": optimizer, "data": batches, "rng": GlobalRng()}
    with CheckpointManager(url, keep_last=keep_last, every=every) as mgr:
        began = time.time()
        start = mgr.restore(state)  # the step it loaded, or None: the run has no checkpoint yet
        if start is not None:
            emit("resume", url=f"{url}/{step_name(start)}", step=start, t0=began, t1=time.time())
        for step in range((start or 0) + 1, steps + 1):
            began = time.time()
            tokens = next(batches)
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            emit("step", step=step, loss=loss.item(), t0=began, t1=time.time())
            began = time.time()
            if mgr.save(step, state):  # every ``every`` steps: waits for the previous save,
                # stages this one (the stall), and uploads it in the background
                emit("save", step=step, t0=began, t1=time.time(), bytes=state_bytes(state))
                commits.watch(step)
        mgr.wait()  # the last save is durable (or raises its error)
    commits.wait()
