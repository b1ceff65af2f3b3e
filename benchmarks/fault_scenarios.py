"""One fault at a time, as an unlucky operator meets it: the scenario table of bench_faults.

Each scenario runs on its own prefix with s3ckpt's default retry settings, through a
`FaultProxy` in front of the server (a local SeaweedFS for the restarts), and records whether the
save and the load succeeded, how long they took, and the state of the prefix afterwards: does the
last completed save load bit for bit, and after ``gc --older-than 0`` (once the leases of killed
saves have expired) are there zero uploads in progress and zero unreferenced objects?
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import multiprocessing
import random
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed.checkpoint as dcp
from botocore.client import BaseClient
from torch.distributed.checkpoint.api import CheckpointException

from s3ckpt import S3Reader, S3Writer
from s3ckpt.config import MiB, S3Config
from s3ckpt.format import layout
from s3ckpt.testing.faultproxy import (
    Delay,
    FaultProxy,
    LateApply,
    ResetAfter,
    Status,
    Trickle,
    TrickleHead,
)
from s3ckpt.tools.catalog import gc
from s3ckpt.tools.localserver import SeaweedFS

from .bench_faults import backdoor, differing, leftovers, make_state, uploads_of
from .common import Endpoint

__all__ = ["Server", "run_scenarios", "scenario_table"]

_PARTS = {"part_size": 5 * MiB, "multipart_threshold": 5 * MiB}
T = TypeVar("T")
Outcome = tuple[bool, float, str | None]  # succeeded, seconds, error
_KILLS = 20


def _state(size: int, step: int) -> dict[str, torch.Tensor]:
    state = make_state(size, step)
    state["step"].fill_(step)
    return state


def _timed(call: Callable[[], Any]) -> Outcome:
    started = time.perf_counter()
    try:
        call()
    except (Exception, CheckpointException) as e:  # DCP's wrapper is a BaseException
        error = next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) else e
        return False, time.perf_counter() - started, f"{type(error).__name__}: {error}"[:300]
    return True, time.perf_counter() - started, None


def _save(config: S3Config, bucket: str, prefix: str, state: dict[str, torch.Tensor]) -> None:
    writer = S3Writer(bucket, prefix, config=config, overwrite=True)
    dcp.save(state, storage_writer=writer, no_dist=True)


def _loads_as(config: S3Config, bucket: str, prefix: str, state: dict[str, torch.Tensor]) -> None:
    loaded = {name: torch.zeros_like(t) for name, t in state.items()}
    dcp.load(loaded, storage_reader=S3Reader(bucket, prefix, config=config), no_dist=True)
    differ = differing(loaded, state)
    if differ:
        raise AssertionError(f"loaded tensors differ: {differ}")


def _aftermath(
    client: BaseClient,
    config: S3Config,
    bucket: str,
    prefix: str,
    last: dict[str, torch.Tensor],
    leases_until: float = 0.0,
) -> dict[str, Any]:
    """Whether the last completed save loads bit-exact, then what gc leaves."""
    exact, _, error = _timed(lambda: _loads_as(config, bucket, prefix, last))
    time.sleep(max(0.0, leases_until - time.monotonic()))
    report = gc(f"s3://{bucket}/{prefix}", older_than=timedelta(0), config=config)
    left = leftovers(client, config, bucket, prefix)
    return {
        "last_save_loads_exact": exact,
        "load_error": error,
        "gc_deleted": len(report.deleted),
        "gc_aborted": len(report.aborted),
        "uploads_in_progress": left["uploads_in_progress"],
        "unreferenced_objects": left["unreferenced_objects"],
        "missing_objects": left["missing_objects"],
    }


def _row(name: str, fault: str, save: Outcome | None, **rest: Any) -> dict[str, Any]:
    """One scenario's row; ``expect`` names the error a correct save raises (then it counts as
    the right outcome, not a failure)."""
    load, expect = rest.pop("load", None), rest.pop("expect", None)
    if save is not None and expect is not None:
        save = (not save[0] and f"{expect}:" in (save[2] or ""), save[1], save[2])
    return {
        "scenario": name,
        "fault": fault,
        "expected_error": expect,
        "save_ok": None if save is None else save[0],
        "save_s": None if save is None else save[1],
        "save_error": None if save is None else save[2],
        "load_ok": None if load is None else load[0],
        "load_s": None if load is None else load[1],
        "load_error": None if load is None else load[2],
        **rest,
    }


@contextlib.contextmanager
def _in_thread(call: Callable[[], Any]) -> Iterator[list[Outcome]]:
    """Run ``call`` timed in a thread; the list holds its result once the block has exited."""
    out: list[Outcome] = []
    thread = threading.Thread(target=lambda: out.append(_timed(call)))
    thread.start()
    try:
        yield out
    finally:
        thread.join(300)


def _wait_for(condition: Callable[[], bool], seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError("the fault's moment never came")
        time.sleep(0.05)


def _part_stored(client: BaseClient, bucket: str, prefix: str) -> bool:
    return any(
        client.list_parts(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"]).get("Parts")
        for u in uploads_of(client, bucket, f"{prefix}/")
    )


class Server:
    """Where the scenarios' server is now: a local SeaweedFS moves to new ports on a restart."""

    def __init__(self, endpoint: Endpoint, weed: SeaweedFS | None = None) -> None:
        self.endpoint, self.weed = endpoint, weed

    def config(self, **overrides: Any) -> S3Config:
        """s3ckpt's defaults (retries included), small parts, and the overrides."""
        e = self.endpoint
        settings = {"endpoint_url": e.url, "region": e.region, **_PARTS, **overrides}
        return S3Config(
            access_key_id=e.access_key_id, secret_access_key=e.secret_access_key, **settings
        )

    def client(self) -> BaseClient:
        return backdoor(self.endpoint)

    def restart(self, proxy: FaultProxy) -> float:
        """Stop the server and start it on its data again; the proxy follows it."""
        assert self.weed is not None
        started = time.perf_counter()
        self.weed.stop()
        url = self.weed.start().endpoint_url
        self.endpoint = dataclasses.replace(self.endpoint, url=url)
        proxy.retarget(url)
        return time.perf_counter() - started


def _save_step(
    config: S3Config, bucket: str, prefix: str, size: int, step: int, began: Any
) -> None:
    """The save that gets killed (module level: a spawned process runs it)."""
    state = _state(size, step)
    began.set()
    _save(config, bucket, prefix, state)


def _kill_loop(
    client: BaseClient, config: S3Config, bucket: str, prefix: str, size: int, seed: int
) -> dict[str, Any]:
    """Overwrite saves of steps 1..20, each SIGKILLed at a random moment of its upload; after
    each kill the prefix must load bit-exact as the last save that committed."""
    rng = random.Random(seed)
    _save(config, bucket, prefix, _state(size, 0))
    _, save_s, _ = _timed(lambda: _save(config, bucket, prefix, _state(size, 0)))
    context = multiprocessing.get_context("spawn")
    last, committed, broken = 0, 0, []
    for step in range(1, _KILLS + 1):
        began = context.Event()
        args = (config, bucket, prefix, size, step, began)
        process = context.Process(target=_save_step, args=args)
        process.start()
        began.wait(120)
        # A spawned child's first save also makes its client (a few tenths of a second): kills
        # land before, during and after the commit.
        time.sleep(rng.uniform(0, 1.5 * save_s + 0.2))
        process.kill()
        process.join(30)
        reader = S3Reader(bucket, prefix, config=config)
        loaded = {name: torch.zeros_like(t) for name, t in _state(size, 0).items()}
        dcp.load(loaded, storage_reader=reader, no_dist=True)
        now = int(loaded["step"].item())
        if now not in (last, step) or differing(loaded, _state(size, now)):
            broken.append(step)
        committed += now == step
        last = now
    return {
        "kills": _KILLS,
        "killed_after_commit": committed,
        "loads_wrong_or_broken": broken,
        "last": _state(size, last),
        "save_s": save_s,
    }


def run_scenarios(
    server: Server, bucket: str, root: str, size: int, seed: int
) -> list[dict[str, Any]]:
    """Every scenario, in order (the restarts only on a local SeaweedFS)."""
    rows: list[dict[str, Any]] = []
    direct, client = server.config(), server.client()
    one, two = _state(size, 1), _state(size, 2)
    with FaultProxy(server.endpoint.url, rng=random.Random(seed)) as proxy:
        config = server.config(endpoint_url=proxy.endpoint_url)

        def prefix(name: str) -> str:
            return f"{root}/{name}"

        def during_save(p: str, stall: float, act: Callable[[], T]) -> tuple[Outcome, Any, T]:
            """Save ``two`` over ``one`` at ``p`` with its parts held back ``stall`` seconds each,
            running ``act`` once a part is stored; the save's outcome, the state the prefix
            should then load as, and what ``act`` returned."""
            _save(direct, bucket, p, one)
            proxy.add_rule(Delay(stall), op="UploadPart")
            with _in_thread(lambda: _save(config, bucket, p, two)) as out:
                _wait_for(lambda: _part_stored(client, bucket, p))
                result = act()
            proxy.clear_rules()
            return out[0], two if out[0][0] else one, result

        print("scenario: commit answers lost", flush=True)
        p = prefix("commit-lost")
        _save(direct, bucket, p, one)
        rule = proxy.add_rule(ResetAfter(), op="PutObject", key=".metadata")
        save = _timed(lambda: _save(config, bucket, p, two))
        proxy.clear_rules()
        rows.append(
            _row(
                "commit answers lost",
                f"every answer to the commit PUT reset after the server acted ({rule.fired}x)",
                save,
                **_aftermath(client, direct, bucket, p, two if save[0] else one),
            )
        )

        print("scenario: a 503 that the store applies later", flush=True)
        p = prefix("late-503")
        _save(direct, bucket, p, one)
        late = LateApply(Status(503, "SlowDown"), 5.0)
        rule = proxy.add_rule(late, op="PutObject", key=f"{p}/.metadata")
        save = _timed(lambda: _save(config, bucket, p, two))
        proxy.clear_rules()
        rows.append(
            _row(
                "503 applied later",
                f"a balancer answered 503 to every commit PUT ({rule.fired}x) and the store "
                "applied each 5 s later: no data deleted, the record read back",
                save,
                **_aftermath(client, direct, bucket, p, two if save[0] else one),
            )
        )

        print("scenario: objects deleted while the commit is in flight", flush=True)
        p = prefix("lapsed-lease")
        url = f"s3://{bucket}/{p}"
        _save(direct, bucket, p, one)
        held = proxy.add_rule(Delay(2.0), op="PutObject", key=f"{p}/.metadata")
        with _in_thread(lambda: _save(config, bucket, p, two)) as out:
            _wait_for(lambda: held.fired > 0)
            report = gc(url, older_than=timedelta(0), config=direct, break_leases=True)
        proxy.clear_rules()
        rows.append(
            _row(
                "lease lapsed mid-commit",
                f"gc --break-leases deleted the save's {len(report.deleted)} objects while its "
                "commit PUT was held back: the save fails, the old record is put back",
                out[0],
                expect="IncompleteCheckpoint",
                **_aftermath(client, direct, bucket, p, one),
            )
        )

        for phase in ("save", "load"):
            print(f"scenario: brownout during the {phase}", flush=True)
            p = prefix(f"brownout-{phase}")
            if phase == "load":
                _save(direct, bucket, p, one)
            rule = proxy.add_rule(Status(503, "SlowDown"), for_seconds=5.0)
            saved: Outcome | None = None
            if phase == "save":
                saved = _timed(functools.partial(_save, config, bucket, p, one))
            load = _timed(functools.partial(_loads_as, config, bucket, p, one))
            proxy.clear_rules()
            rows.append(
                _row(
                    f"brownout 5 s, {phase}",
                    f"every request answered 503 SlowDown for 5 s ({rule.fired} requests)",
                    saved,
                    load=load,
                    **_aftermath(client, direct, bucket, p, one),
                )
            )

        if server.weed is not None:
            print("scenario: server restart mid-save", flush=True)
            p = prefix("restart-save")
            save, last, restart_s = during_save(p, 0.5, lambda: server.restart(proxy))
            direct, client = server.config(), server.client()
            rows.append(
                _row(
                    "server restart, save",
                    f"SeaweedFS stopped and started again ({restart_s:.1f} s) mid-upload",
                    save,
                    **_aftermath(client, direct, bucket, p, last),
                )
            )

            print("scenario: server restart mid-load", flush=True)
            p = prefix("restart-load")
            _save(direct, bucket, p, one)
            rule = proxy.add_rule(Delay(0.5), op="GetObject", key="/data-")
            with _in_thread(lambda: _loads_as(config, bucket, p, one)) as out:
                _wait_for(lambda: rule.fired > 0)
                restart_s = server.restart(proxy)
            proxy.clear_rules()
            direct, client = server.config(), server.client()
            rows.append(
                _row(
                    "server restart, load",
                    f"SeaweedFS stopped and started again ({restart_s:.1f} s) mid-load",
                    None,
                    load=out[0],
                    **_aftermath(client, direct, bucket, p, one),
                )
            )

        print("scenario: trickling response", flush=True)
        p = prefix("trickle")
        _save(direct, bucket, p, one)
        proxy.add_rule(Trickle(4096), op="GetObject", key="/data-", times=1)
        load = _timed(lambda: _loads_as(config, bucket, p, one))
        proxy.clear_rules()
        rows.append(
            _row(
                "trickle",
                "one ranged GET's body relayed at 4 KiB/s",
                None,
                load=load,
                **_aftermath(client, direct, bucket, p, one),
            )
        )

        print("scenario: a response head that never ends", flush=True)
        p = prefix("trickled-head")
        _save(direct, bucket, p, one)
        proxy.add_rule(TrickleHead(4), op="GetObject", key=f"{p}/.metadata", times=1)
        quick = server.config(endpoint_url=proxy.endpoint_url, read_timeout=5.0)
        load = _timed(lambda: _loads_as(quick, bucket, p, one))
        proxy.clear_rules()
        rows.append(
            _row(
                "trickled response head",
                "the record GET's status line and headers relayed at 4 B/s (read_timeout=5): "
                "cut at connect_timeout + read_timeout, retried",
                None,
                load=load,
                **_aftermath(client, direct, bucket, p, one),
            )
        )

        print("scenario: gc --older-than 0 mid-save", flush=True)
        p = prefix("gc-mid-save")
        url = f"s3://{bucket}/{p}"
        save, last, report = during_save(
            p, 3.0, lambda: gc(url, older_than=timedelta(0), config=direct)
        )
        spared = len(report.skipped) + len(report.skipped_uploads)
        rows.append(
            _row(
                "gc --older-than 0, mid-save",
                f"gc ran while the save uploaded: deleted {len(report.deleted)}, aborted "
                f"{len(report.aborted)}, spared {spared}",
                save,
                **_aftermath(client, direct, bucket, p, last),
            )
        )

    print(f"scenario: SIGKILL loop of {_KILLS} overwrite saves", flush=True)
    p = f"{root}/kill-loop"
    killed = _kill_loop(client, direct, bucket, p, size, seed)
    until = time.monotonic() + layout.LEASE_TTL
    print(f"  waiting {layout.LEASE_TTL:.0f} s for the killed saves' leases to expire", flush=True)
    after = _aftermath(client, direct, bucket, p, killed.pop("last"), leases_until=until)
    ok = not killed["loads_wrong_or_broken"]
    rows.append(
        _row(
            f"SIGKILL loop, {_KILLS} overwrite saves",
            f"each save killed at a random moment of its upload ({killed['killed_after_commit']} "
            "had committed)",
            (ok, killed["save_s"], None if ok else f"broken at {killed['loads_wrong_or_broken']}"),
            **after,
        )
    )
    return rows


def scenario_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    def outcome(ok: bool | None, seconds: float | None, expected: str | None = None) -> str:
        if ok is None:
            return "-"
        return f"{(expected or 'ok') if ok else 'FAILED'} {seconds:.1f} s"

    headers = ["scenario", "save", "load", "last save exact", "uploads", "unref", "fault"]
    body = [
        [
            row["scenario"],
            outcome(row["save_ok"], row["save_s"], row.get("expected_error")),
            outcome(row["load_ok"], row["load_s"]),
            "yes" if row["last_save_loads_exact"] else "NO",
            row["uploads_in_progress"],
            row["unreferenced_objects"],
            row["fault"],
        ]
        for row in rows
    ]
    return headers, body
