"""The demo's story: train and kill mid-upload, gc, restart and resume, train an uninterrupted
reference, and compare the two runs bit for bit."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from ... import S3Config
from ...config import parse_s3_url
from ...engine import bridge
from ...engine.contract import ObjectStore
from ...engine.store import get_store
from ...format.layout import step_name
from .. import catalog
from . import report
from .child import Child, DemoError

__all__ = ["Demo", "Verdict", "identical"]

_CATCH_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Verdict:
    """How the interrupted run compares with the reference."""

    resumed_from: int
    losses: tuple[int, int]  # (identical, compared), every step the interrupted run took
    resumed_losses: tuple[int, int]  # the same, after the resume only
    checkpoints: tuple[int, int]  # (bitwise-equal, compared)
    tensors: int  # per checkpoint

    @property
    def exact(self) -> bool:
        return all(same == total > 0 for same, total in self._counts)

    @property
    def _counts(self) -> tuple[tuple[int, int], ...]:
        return (self.losses, self.resumed_losses, self.checkpoints)

    def line(self) -> str:
        (loss, losses), (after, afters), (ckpt, ckpts) = self._counts
        return (
            f"exact continuation: {'YES' if self.exact else 'NO'} — resumed after step "
            f"{self.resumed_from}; {after}/{afters} losses after the resume identical to the "
            f"uninterrupted run ({loss}/{losses} in all); {ckpt}/{ckpts} checkpoints bitwise-equal "
            f"(torch.equal on {self.tensors} tensors each)"
        )


def identical(a: Any, b: Any) -> int | None:
    """How many tensors ``a`` and ``b`` hold if they are equal (same structure, dtypes and values,
    by torch.equal), else None."""
    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return 1 if same else None
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return None
        pairs = [(a[key], b[key]) for key in a]
    elif isinstance(a, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return None
        pairs = list(zip(a, b, strict=True))
    else:
        return 0 if a == b else None
    counts = [identical(x, y) for x, y in pairs]
    return None if None in counts else sum(c for c in counts if c is not None)


class Demo:
    """One demo run against one endpoint; `run` returns the exit code."""

    def __init__(
        self, args: argparse.Namespace, config: S3Config, env: dict[str, str], local: bool
    ) -> None:
        self.args = args
        self.config = config
        self.env = env
        self.local = local
        self.run_url = f"s3://{args.bucket}/demo-{int(time.time())}"
        self.train_url = f"{self.run_url}/train"
        self.reference_url = f"{self.run_url}/reference"
        self.store = get_store(config)
        self.children: list[Child] = []
        self.gc_window = (0.0, 0.0)

    def run(self) -> int:
        bridge.run(self.store.create_bucket(self.args.bucket))
        try:
            first = self._interrupted()
            self._collect_garbage()
            restarted = self._restarted()
            reference = self._reference()
        finally:
            for child in self.children:
                child.stop()
        verdict = self._compare(first, restarted, reference)
        stored = {
            info.step: info.total_bytes
            for info in catalog.list_checkpoints(self.train_url, self.config)
            if info.committed and info.step is not None
        }
        print(f"\nCheckpoints of the interrupted run ({self.train_url}):")
        print(report.table(first, restarted, stored))
        committed = sorted({e["step"] for child in (first, restarted) for e in child.of("saved")})
        pruned = [step for step in committed if step not in stored]
        print(
            f"retention (keep_last={self.args.keep_last}): kept steps {sorted(stored)}, "
            f"deleted {pruned or 'none'} after later commits"
        )
        out = Path(self.args.out).resolve()
        report.timeline(out, first, restarted, reference, self.gc_window)
        if not (self.local or self.args.keep):
            self._remove()
        print(f"\n{verdict.line()}")
        print(f"timeline: {out}")
        return 0 if verdict.exact else 1

    def _start(self, role: str, url: str, *, quiet: bool = False) -> Child:
        args = self.args
        argv = ["--url", url, "--steps", str(args.steps), "--every", str(args.every)]
        argv += ["--batch", str(args.batch), "--keep-last", str(args.keep_last)]
        child = Child(role, argv, self.env, quiet=quiet)
        self.children.append(child)
        return child

    def _interrupted(self) -> Child:
        step = self.args.kill_at
        print(f"\n1. Train; SIGKILL the process while the checkpoint of step {step} uploads")
        child = self._start("first", self.train_url)
        open_uploads, uploaded = 0, 0
        for event in child:
            if event["event"] == "save" and event["step"] == step:
                open_uploads, uploaded = self._wait_for_upload(child, step)
                child.kill()
                break
        child.finish()
        if child.killed_at is None:
            raise DemoError(f"the first run never saved step {step}")
        reached = child.of("step")[-1]["step"]
        print(
            f"  [first] SIGKILL after step {reached}: {open_uploads} multipart upload(s) of "
            f"{step_name(step)} open, {uploaded / 1e6:.1f} MB of their parts on the server"
        )
        left = [i for i in catalog.list_checkpoints(self.train_url, self.config) if i.step == step]
        if not left or left[0].committed:
            raise DemoError(f"step {step} was committed before the kill landed")
        bucket, prefix = parse_s3_url(left[0].url)
        uploads = bridge.run(self.store.list_uploads(bucket, f"{prefix}/"))
        print(
            f"  left behind at {left[0].url}: no .metadata, {left[0].num_objects} data objects "
            f"({left[0].total_bytes / 1e6:.1f} MB), {len(uploads)} multipart upload(s)"
        )
        return child

    def _wait_for_upload(self, child: Child, step: int) -> tuple[int, int]:
        """Poll until parts of the save of ``step`` have reached the server while it still has
        uploads open; how many uploads are open, and the bytes of their parts."""
        bucket, prefix = parse_s3_url(f"{self.train_url}/{step_name(step)}")
        deadline = time.monotonic() + _CATCH_TIMEOUT_S
        while time.monotonic() < deadline and child.proc.poll() is None:
            found = bridge.run(_in_flight(self.store, bucket, prefix))
            if found is None:
                break
            if found[1]:
                return found
            time.sleep(0.005)
        raise DemoError(f"no upload of step {step} was caught in progress (it finished first)")

    def _collect_garbage(self) -> None:
        print("\n2. gc: remove what the killed save left behind")
        started = time.time()
        spared = catalog.gc(self.train_url, timedelta(0), self.config)
        print(
            f"  without --break-leases: {len(spared.deleted)} objects deleted, "
            f"{len(spared.skipped) + len(spared.skipped_uploads)} spared (the killed save's lease "
            "is still live: for gc it might be running)"
        )
        # Safe only because the save's writer is known to be dead.
        done = catalog.gc(self.train_url, timedelta(0), self.config, break_leases=True)
        self.gc_window = (started, time.time())
        print(
            f"  gc {self.train_url} --older-than 0 --break-leases: deleted "
            f"{len(done.deleted)} objects ({done.bytes_freed / 1e6:.1f} MB), aborted "
            f"{len(done.aborted)} multipart upload(s)"
        )
        for key in done.deleted:
            print(f"    deleted s3://{done.bucket}/{key}")
        for upload in done.aborted:
            print(f"    aborted the upload of s3://{done.bucket}/{upload.key}")
        infos = catalog.list_checkpoints(self.train_url, self.config)
        print(f"  incomplete checkpoints left: {sum(not i.committed for i in infos)}")

    def _restarted(self) -> Child:
        print("\n3. Restart: a new process resumes from the latest committed checkpoint")
        child = self._start("restarted", self.train_url)
        child.finish()
        if not child.of("resume"):
            raise DemoError("the restarted run found no checkpoint to resume from")
        return child

    def _reference(self) -> Child:
        print(f"\n4. The same training without interruption, for reference: {self.reference_url}")
        child = self._start("reference", self.reference_url, quiet=True)
        child.finish()
        assert child.ended is not None
        print(
            f"  [reference] {len(child.of('step'))} steps and {len(child.of('saved'))} "
            f"checkpoints in {child.ended - child.spawned:.1f} s"
        )
        return child

    def _compare(self, first: Child, restarted: Child, reference: Child) -> Verdict:
        print("\nComparing with the reference: every loss, and every checkpoint, bit for bit")
        expected = {event["step"]: event["loss"] for event in reference.of("step")}

        def matches(events: list[dict[str, Any]]) -> tuple[int, int]:
            return sum(e["loss"] == expected.get(e["step"]) for e in events), len(events)

        steps = first.of("step") + restarted.of("step")
        equal, tensors = 0, 0
        infos = [i for i in catalog.list_checkpoints(self.train_url, self.config) if i.committed]
        for info in infos:
            name = info.prefix.rpartition("/")[2]
            ours = catalog.read_state(info.url, self.config)
            theirs = catalog.read_state(f"{self.reference_url}/{name}", self.config)
            count = identical(ours, theirs)
            print(f"  {name}: {'bitwise-equal' if count is not None else 'DIFFERENT'}")
            if count is not None:
                equal, tensors = equal + 1, count
        return Verdict(
            resumed_from=restarted.of("resume")[0]["step"],
            losses=matches(steps),
            resumed_losses=matches(restarted.of("step")),
            checkpoints=(equal, len(infos)),
            tensors=tensors,
        )

    def _remove(self) -> None:
        """On an endpoint the demo did not start, leave nothing behind (unless --keep)."""
        removed = 0
        for url in (self.train_url, self.reference_url):
            for info in catalog.list_checkpoints(url, self.config):
                catalog.delete(info.url, self.config)
                removed += 1
        print(
            f"\nremoved the demo's {removed} checkpoints under {self.run_url} (--keep keeps them)"
        )


async def _in_flight(store: ObjectStore, bucket: str, prefix: str) -> tuple[int, int] | None:
    """Uploads open under ``prefix`` and the bytes of their parts; None once it is committed."""
    open_uploads = await store.list_uploads(bucket, f"{prefix}/")
    if not open_uploads:
        committed = await store.head(bucket, f"{prefix}/.metadata")
        return None if committed is not None else (0, 0)
    uploaded = 0
    for upload in open_uploads:
        uploaded += sum(part.size for part in await store.list_parts(bucket, upload))
    return len(open_uploads), uploaded
