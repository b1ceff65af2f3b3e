"""Where a checkpoint's objects live: the commit record, data objects and leases. No I/O.

A checkpoint at ``prefix`` is the commit record ``prefix/.metadata`` plus data objects
``prefix/data-<save_id>/<rank>-<n>``. Every save draws a fresh ``save_id``, so a save never writes
an object that a committed checkpoint references: replacing a checkpoint is one PUT of
``.metadata``, and a save that dies leaves only objects that no ``.metadata`` names. While a save
runs, its lease ``prefix/data-<save_id>/.lease`` is rewritten every ``LEASE_TTL / 4`` seconds;
removals leave a save alone while its lease is younger than ``LEASE_TTL`` (see `s3ckpt.dcp.commit`).

An incremental save's record may also reference data objects of its siblings (checkpoints under
the same parent prefix, the run): such a key is relative to the checkpoint too,
``../<sibling>/data-<save_id>/<name>`` (`reference`), and always names the object that holds the
bytes, never a record in between (see `s3ckpt.dcp.incremental`).
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass

from ..config import parse_s3_url
from ..errors import ConfigError

__all__ = [
    "LEASE_NAME",
    "LEASE_TTL",
    "METADATA_NAME",
    "PIN_GRACE",
    "STEP_WIDTH",
    "Location",
    "data_key",
    "is_data_object",
    "is_lease",
    "is_pin",
    "is_reference",
    "is_save_dir",
    "lease_key",
    "new_save_id",
    "pin_owner",
    "rank_of",
    "reference",
    "referenced_save",
    "save_dir",
    "save_of",
    "spread_digits",
    "step_in",
    "step_name",
    "step_of",
]

METADATA_NAME = ".metadata"
LEASE_NAME = ".lease"
# Seconds a lease protects its save after its last refresh, by the server's clock. Part of the
# on-store protocol: writers refresh four times within it, removals read it.
LEASE_TTL = 60.0
# Seconds a removal may take from reading a run's records to listing the leases in what it
# deletes (else it looks again). An incremental save leaves its pins refreshed at its commit, to
# expire LEASE_TTL later: so a removal that read the records before that commit sees the pins.
PIN_GRACE = LEASE_TTL / 2


@dataclass(frozen=True)
class Location:
    """Bucket and prefix of a checkpoint; the prefix has no end slashes, empty is the root."""

    bucket: str
    prefix: str

    @classmethod
    def of(cls, bucket: str, prefix: str = "") -> Location:
        """Accepts ``("bucket", "a/b")`` or a whole URL ``("s3://bucket/a/b")``."""
        if bucket.startswith("s3://"):
            bucket, url_prefix = parse_s3_url(bucket)
            prefix = prefix or url_prefix
        return cls(bucket, prefix.strip("/"))

    def moved_to(self, checkpoint_id: str) -> Location:
        """DCP's ``checkpoint_id``: an ``s3://`` URL, or a prefix in the same bucket."""
        if checkpoint_id.startswith("s3://"):
            return Location(*parse_s3_url(checkpoint_id))
        return Location(self.bucket, checkpoint_id.strip("/"))

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    @property
    def name(self) -> str:
        """The last component of the prefix: what a sibling's reference calls this checkpoint."""
        return self.prefix.rpartition("/")[2]

    @property
    def parent(self) -> Location:
        """The run this checkpoint belongs to: the prefix one level up."""
        return Location(self.bucket, self.prefix.rpartition("/")[0])

    def key(self, relative: str) -> str:
        if relative.startswith(_UP):
            return self.parent.key(relative[len(_UP) :])
        return f"{self.prefix}/{relative}" if self.prefix else relative

    @property
    def metadata_key(self) -> str:
        return self.key(METADATA_NAME)

    @property
    def metadata_url(self) -> str:
        return f"s3://{self.bucket}/{self.metadata_key}"

    @property
    def listing_prefix(self) -> str:
        """The prefix that lists exactly this checkpoint's objects."""
        return f"{self.prefix}/" if self.prefix else ""


def new_save_id() -> str:
    """96 random bits: unique across jobs and retries without coordination."""
    return secrets.token_hex(12)


def data_key(save_id: str, rank: int, index: int, spread: int = 0, nonce: str = "") -> str:
    """Key of one data object, relative to the checkpoint prefix.

    ``nonce`` is drawn by each rank for each save: DCP's plan caching hands a later save the
    plans (and so the save id) of an earlier one, and without it the later save would rewrite
    the committed checkpoint's objects. With ``spread`` digits, a hash of the rank and index
    comes first, so that one save's requests fan out over ``16**spread`` key ranges instead of
    a run of sequential names (stores such as AWS S3 partition request rates by key range).
    The hash leaves the nonce out, so that an object gets the same digits in every save: every
    save spreads over its directory alike. It cannot go before the directory, the first part
    that changes between saves (see docs/scaling.md): a save's objects live in its own.
    """
    slot = f"{rank:05d}-{index:03d}"
    name = slot + (f"-{nonce}" if nonce else "")
    if spread:
        name = f"{hashlib.blake2b(slot.encode(), digest_size=8).hexdigest()[:spread]}/{name}"
    return f"data-{save_id}/{name}"


def lease_key(save_id: str) -> str:
    """Key of a running save's lease, relative to the checkpoint prefix: inside the save's
    ``data-<save_id>/`` so that listings group it with the save's objects."""
    return f"data-{save_id}/{LEASE_NAME}"


# What s3ckpt's writer names, in every version so far: a save's directory ``data-<save_id>``
# (`new_save_id`: 24 hex digits) holding its data objects ``[<hash>/]<rank>-<index>[-<nonce>]``
# (`data_key`), its lease and its pins ``[<token>/].lease`` (`lease_key`, `commit.ReadLease`).
# Removals delete nothing else: a bucket is shared with datasets and logs, and a ``data-2024/``
# directory of someone else's is not a save.
_SAVE_ID = r"[0-9a-f]{24}"
_SAVE_DIR = re.compile(rf"data-(?P<save>{_SAVE_ID})")
_SAVE_KEY = re.compile(
    rf"data-(?P<save>{_SAVE_ID})/(?:"
    r"(?:[0-9a-f]{2,4}/)?(?P<rank>\d{5,})-\d{3,}(?:-[0-9a-f]{6})?"
    rf"|(?:[0-9a-f]{{16}}/|{_SAVE_ID}/)?{re.escape(LEASE_NAME)})"
)

_PIN = re.compile(
    rf"(?:.*/)?data-{_SAVE_ID}/(?:[0-9a-f]{{16}}|(?P<owner>{_SAVE_ID}))/{re.escape(LEASE_NAME)}"
)


def is_save_dir(name: str) -> bool:
    """Whether a child prefix's name is a save's directory (``data-<save_id>``)."""
    return _SAVE_DIR.fullmatch(name) is not None


def save_of(key: str) -> str | None:
    """The save that wrote an object (key relative to the checkpoint prefix): its data objects,
    its lease and its pins; None for any other key, also one inside a save's directory that
    s3ckpt does not write."""
    match = _SAVE_KEY.fullmatch(key)
    return match["save"] if match else None


def is_data_object(key: str) -> bool:
    """Whether a key relative to the checkpoint prefix is a data object by `data_key`."""
    match = _SAVE_KEY.fullmatch(key)
    return match is not None and match["rank"] is not None


def save_dir(key: str) -> str:
    """The listing prefix (``.../data-<save_id>/``) of the save directory that an absolute data
    key is in; for a key in none, the key itself (a listing of just that object)."""
    parts = key.split("/")
    for i in range(len(parts) - 2, -1, -1):
        if is_save_dir(parts[i]):
            return "/".join(parts[: i + 1]) + "/"
    return key


def rank_of(key: str) -> int | None:
    """The rank that wrote a data object, from its `data_key`; None for any other key."""
    match = _SAVE_KEY.fullmatch(key)
    return int(match["rank"]) if match and match["rank"] is not None else None


_UP = "../"
_REFERENCE = re.compile(r"\.\./(?P<sibling>[^/]+)/(?P<data>data-[^/]+/.+)")


def reference(base: str, key: str) -> str:
    """``key``, relative to the checkpoint named ``base``, made relative to a sibling of it.

    A key that is already a reference stays as it is: siblings share their parent, so the same
    text names the same object from each of them (a reference never chains).
    """
    return key if key.startswith(_UP) else f"{_UP}{base}/{key}"


def is_reference(key: str) -> bool:
    """Whether a record's key names a sibling checkpoint's object rather than one of its own."""
    return key.startswith(_UP)


def referenced_save(key: str) -> tuple[str, str] | None:
    """``(sibling, save_id)`` of the save whose data object a valid reference names, else
    None."""
    match = _REFERENCE.fullmatch(key)
    if match is None or match["sibling"] in (".", "..") or not is_data_object(match["data"]):
        return None
    save = save_of(match["data"])
    return None if save is None else (match["sibling"], save)


def is_lease(key: str) -> bool:
    return key.rpartition("/")[2] == LEASE_NAME


def is_pin(key: str) -> bool:
    """A lease with a token of its own, ``data-<save_id>/<token>/.lease``: a reader's, or an
    incremental save's on a save it references (`s3ckpt.dcp.commit.ReadLease`)."""
    return _PIN.fullmatch(key) is not None


def pin_owner(key: str) -> str | None:
    """The save that holds a pin (`is_pin`) whose token is a save id: an incremental save's
    pin on what it references, which that save's committed record makes redundant."""
    match = _PIN.fullmatch(key)
    return match["owner"] if match else None


def spread_digits(objects: int) -> int:
    """Hex digits of the hash component: about one object per key range, 2 to 4 digits."""
    digits = 2
    while digits < 4 and 16**digits < objects:
        digits += 1
    return digits


# Steps. The manager names a run's checkpoints ``step-<step>``, zero-padded to `STEP_WIDTH`
# digits so that names sort like numbers (`step_name`), and finds its run's children by that
# pattern alone, any width (`step_in`: strict, since retention deletes by it). Anything else
# reads a step from whatever a checkpoint's last path component is called (`step_of`: lenient,
# "global_step1000", "ckpt_42", "7"; not "best-epoch3" or "run-2024-06-01", which are names).
STEP_WIDTH = 9
_RUN_STEP = re.compile(r"step-(\d+)")
_ANY_STEP = re.compile(r"(?:[A-Za-z][A-Za-z_]*[-_]?)?(\d+)")


def step_name(step: int) -> str:
    """``step-000000100`` for step 100."""
    if step < 0:
        raise ConfigError(f"a step must be >= 0, got {step}")
    return f"step-{step:0{STEP_WIDTH}d}"


def step_in(name: str) -> int | None:
    """The step a child prefix of a run names (``step-<digits>``); None for any other name."""
    match = _RUN_STEP.fullmatch(name)
    return int(match.group(1)) if match else None


def step_of(prefix: str) -> int | None:
    """The step a checkpoint's prefix names in its last component, or None."""
    match = _ANY_STEP.fullmatch(prefix.rpartition("/")[2])
    return int(match.group(1)) if match else None
