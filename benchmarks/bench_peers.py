"""s3ckpt next to its peers, in one run against one server: save, async stall, load, memory, CPU.

Systems: s3ckpt (defaults), s3ckpt-tuned (part size and concurrency, ``--tuned``),
s3torchconnector (S3StorageWriter/Reader), fsspec (torch FsspecWriter/Reader over s3fs),
local (torch FileSystemWriter/Reader on local disk: a reference, not a peer) and raw (the bytes
moved by the thinnest aiobotocore code, `benchmarks.raw`, with the tuned settings: the ceiling).
Workloads: see `benchmarks.peers`. Every case runs in a fresh child process with a timeout, so a
peer that hangs or crashes is recorded as failed; repetitions are interleaved; medians reported.

The peers need their own venv (s3fs and s3torchconnector must not touch the project's .venv):

    python3 -m venv .venv-peers
    .venv-peers/bin/pip install torch==2.13.0            # first: the local wheel
    .venv-peers/bin/pip install -e . -r benchmarks/requirements-peers.txt
    .venv-peers/bin/python -m benchmarks.bench_peers                      # 2 GiB, 3 reps, SeaweedFS
    .venv-peers/bin/python -m benchmarks.bench_peers --size-gib 0.25 --small-count 2000 --repeat 1
    .venv-peers/bin/python -m benchmarks.bench_peers --server ceph        # benchmarks/ceph/*.sh

Figures: stall = time `dcp.async_save` blocks (steady state: the second save with the same
writer, to a new checkpoint id, as a training job does); durable = from that call until its
future resolves; save GB/s = bytes / durable; load GB/s = bytes asked for / `dcp.load` time;
+MiB = peak RSS over the RSS with the state in memory before the first save (so buffers kept
between saves count) or with the destination tensors allocated before the load; CPU = the
client process's user+sys; requests and bytes on the wire come from a counting proxy on
127.0.0.1 that every client goes through (``--no-proxy`` to take it out: it costs throughput).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from s3ckpt.config import MiB
from s3ckpt.tools.localserver import free_port

from . import chart, options
from .common import RESULTS, ROOT, CountingProxy, Endpoint, machine_info, write_json
from .peer_cases import child_main
from .peers import SYSTEMS, WORKLOADS, Target, peer_env
from .raw import RawClient

_CEPH = ROOT / "benchmarks" / "ceph"
_TUNED = (32, 16)  # part size MiB, max concurrency: see --tuned auto
_SWEEP = ((8, 32), (16, 32), (32, 16), (64, 8))
_GiB = 1024 * MiB


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = options.Parser(__file__, __doc__)
    p.size_gib(2.0, "large state dict")
    p.add_argument(
        "--small-count", type=options.positive_int, default=20_000, help="tensors in 'small'"
    )
    help = "the server to start unless --endpoint-url (ceph: benchmarks/ceph/*.sh)"
    p.add_argument("--server", choices=("seaweedfs", "ceph"), default="seaweedfs", help=help)
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument(
        "--tuned", default=f"{_TUNED[0]},{_TUNED[1]}", help="PART_MIB,CONCURRENCY or 'auto'"
    )
    p.add_argument("--no-proxy", action="store_true", help="no request counting proxy")
    p.add_argument("--keep-ceph", action="store_true", help="leave a Ceph it started running")
    p.chart(RESULTS / "peers.png", "--png")
    p.repeat(3)
    p.seed()
    p.timeout("300 s + 240 s per GiB")
    p.server(bucket="s3ckpt-peers")
    p.json("peers.json")
    p.child()  # one case, as JSON
    args = p.parse(argv)
    args.region = args.region or "us-east-1"  # the peers' clients want one named
    if args.tuned != "auto":
        try:
            part, conc = (int(v) for v in args.tuned.split(","))
        except ValueError:
            p.error("--tuned takes PART_MIB,CONCURRENCY or auto")
        args.tuned = (part, conc)
    if args.timeout_s is None:
        args.timeout_s = 300.0 + 240.0 * max(args.size_gib, args.small_count * 26.5e3 / _GiB)
    return args


class PeerBench:
    """One run: a target (through the proxy), children per case, clean-up after each case."""

    def __init__(self, args: argparse.Namespace, endpoint: Endpoint, proxy_url: str | None) -> None:
        self.args = args
        self.endpoint = endpoint
        self.local_dir = tempfile.mkdtemp(prefix="s3ckpt-peers-local-")
        self.root = f"peers-{secrets.token_hex(4)}"
        self.size = int(args.size_gib * _GiB)
        self.tuned: tuple[int, int] = _TUNED if args.tuned == "auto" else args.tuned
        self.direct = Target(
            endpoint.url,
            endpoint.access_key_id,
            endpoint.secret_access_key,
            endpoint.region or args.region,
            args.bucket,
            self.local_dir,
            self.tuned[0] * MiB,
            self.tuned[1],
        )
        # The check pass goes through the counting proxy (requests, bytes on the wire) and
        # compares every loaded tensor; the timed repetitions go straight to the server, since
        # a Python relay on the same two cores would slow every system down.
        self.counting_proxy = proxy_url
        self.target = self.direct
        self.proxy: str | None = None
        self.runs: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {}
        self.checks: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {}
        self.failures: list[str] = []
        self.failed: set[tuple[str, str]] = set()
        self.sweep: list[dict[str, Any]] = []

    # -- housekeeping, straight to the server (never through the proxy)
    def _raw(self, coro_of: Any) -> Any:
        async def run() -> Any:
            async with RawClient(self.direct.s3ckpt_config(tuned=False)) as raw:
                return await coro_of(raw)

        return asyncio.run(run())

    def prepare(self) -> None:
        """The bucket, and one warm-up round trip: first writes to a fresh server are slow."""
        self._raw(lambda raw: raw.ensure_bucket(self.args.bucket))
        warm = min(self.size, 256 * MiB)
        spec = self._spec("raw", "raw", "large", f"{self.root}/warmup", size_bytes=warm)
        self._child(spec, "warm-up", counts=False)
        self._forget(f"{self.root}/warmup", "raw")

    def _forget(self, prefix: str, system: str) -> None:
        if system == "local":
            shutil.rmtree(Path(self.local_dir) / prefix, ignore_errors=True)
            return
        try:
            self._raw(lambda raw: raw.delete_prefix(self.args.bucket, prefix + "/"))
        except Exception as e:  # what a failed peer left behind must not end the run
            print(f"  clean-up of {prefix} failed: {type(e).__name__}: {e}", flush=True)
            self.failures.append(f"clean-up of {prefix}: {type(e).__name__}")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._forget(self.root, "raw")
        shutil.rmtree(self.local_dir, ignore_errors=True)

    def _spec(
        self, op: str, system: str, workload: str, prefix: str, **extra: Any
    ) -> dict[str, Any]:
        spec = {
            "op": op,
            "system": system,
            "workload": workload,
            "prefix": prefix,
            "bucket": self.args.bucket,
            "local_dir": self.local_dir,
            "tuned": list(self.tuned),
            "size_bytes": self.size,
            "small_count": self.args.small_count,
            "seed": self.args.seed,
            "verify": False,
            "timeout_s": self.args.timeout_s,
            "proxy": self.proxy,
        }
        spec.update(extra)
        return spec

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "FSSPEC_"))}
        return {**env, **peer_env(self.target), "GLOO_SOCKET_IFNAME": "lo"}

    def _child(
        self, spec: dict[str, Any], label: str, *, counts: bool = True
    ) -> dict[str, Any] | None:
        """Run one case in a fresh interpreter; None (and a failure noted) if it fails."""
        results = self._children([spec], label, counts=counts)
        return results[0] if results else None

    def _children(
        self, specs: list[dict[str, Any]], label: str, *, counts: bool = True
    ) -> list[dict[str, Any]]:
        """Processes started together (the ranks of one save), each in its own session."""
        with tempfile.TemporaryDirectory(prefix="s3ckpt-peers-child-") as tmp:
            outs = [Path(tmp) / f"{i}.json" for i in range(len(specs))]
            logs = [Path(tmp) / f"{i}.log" for i in range(len(specs))]
            procs = []
            for spec, out, log in zip(specs, outs, logs, strict=True):
                command = [sys.executable, "-m", "benchmarks.bench_peers", "--child"]
                command += [json.dumps(spec), "--child-out", str(out)]
                with open(log, "wb") as sink:
                    procs.append(
                        subprocess.Popen(
                            command,
                            cwd=ROOT,
                            env=self._env(),
                            stdout=sink,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,
                        )
                    )
            deadline = time.monotonic() + self.args.timeout_s
            timed_out = False
            for proc in procs:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out = True
            for proc in procs:  # a rank left behind (its peer died) is ended too
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            if timed_out or any(
                p.returncode != 0 or not o.exists() for p, o in zip(procs, outs, strict=True)
            ):
                why = f"timed out after {self.args.timeout_s:g} s" if timed_out else "failed"
                tails = [log.read_text(errors="replace")[-2500:] for log in logs]
                codes = [p.returncode for p in procs]
                self.failures.append(f"{label}: {why} (exit {codes})\n" + "\n".join(tails))
                if counts:  # the warm-up and the sweep are no system's result
                    self.failed.add((specs[0]["system"], specs[0]["workload"]))
                print(f"  {label}: FAILED ({why})", flush=True)
                return []
            return [json.loads(out.read_text()) for out in outs]

    def _record(
        self, system: str, workload: str, op: str, result: dict[str, Any] | None, rep: int | None
    ) -> None:
        if result is None:
            return
        if result.get("mismatched_tensors"):
            self.failed.add((system, workload))
            self.failures.append(
                f"{system} {workload} {op}: {result['mismatched_tensors']} tensors differ"
            )
        store = self.checks if rep is None else self.runs
        store.setdefault(system, {}).setdefault(workload, {}).setdefault(op, []).append(result)
        speed = result["bytes"] / 1e9 / result["seconds"] if result["seconds"] else 0
        print(f"  {system:16} {workload:8} {op:5} {result['seconds']:7.2f} s {speed:6.3f} GB/s")

    def run(self) -> None:
        for rep in [None, *range(self.args.repeat)]:
            if rep is None:
                print("check pass (counting proxy, every tensor compared; not timed)", flush=True)
                self.proxy = self.counting_proxy
                self.target = dataclasses.replace(
                    self.direct, endpoint_url=self.proxy or self.direct.endpoint_url
                )
            else:
                print(f"repetition {rep + 1}/{self.args.repeat}", flush=True)
                self.target, self.proxy = self.direct, None
            for workload in ("large", "small", "reshard"):
                wanted = set(self.args.workloads)
                if workload == "large" and not wanted & {"large", "partial"}:
                    continue
                if workload != "large" and workload not in wanted:
                    continue
                for system in self.args.systems:
                    self.case(system, workload, rep)

    def case(self, system: str, workload: str, rep: int | None) -> None:
        """Save, then load (and partial-load) what was saved, then remove it. ``rep`` None is
        the check pass."""
        prefix = f"{self.root}/{system}/{workload}/{'check' if rep is None else rep}"
        verify = rep is None
        label = f"{system} {workload} rep {rep}"
        if system == "raw":
            if workload == "reshard":
                return
            result = self._child(self._spec("raw", system, workload, prefix), label)
            for op in ("save", "load"):
                self._record(system, workload, op, result[op] if result else None, rep)
            self._forget(prefix, system)
            return
        if workload == "reshard":
            port = free_port()
            specs = [
                self._spec("rank_save", system, workload, f"{prefix}/ckpt", rank=r, world=2)
                for r in range(2)
            ]
            for spec in specs:
                spec["port"] = port
            ranks = self._children(specs, label + " save")
            saved = _merge_ranks(ranks) if len(ranks) == 2 else None
        else:
            saved = self._child(self._spec("save", system, workload, prefix), label + " save")
        if workload in self.args.workloads:
            self._record(system, workload, "save", saved, rep)
        partial = workload == "large" and "partial" in self.args.workloads
        if saved is None and partial:
            self.failed.add((system, "partial"))
        if saved is not None:
            load = self._spec("load", system, workload, f"{prefix}/ckpt", verify=verify)
            if workload in self.args.workloads:
                self._record(system, workload, "load", self._child(load, label + " load"), rep)
            if partial:
                load["workload"] = "partial"
                partial_load = self._child(load, label + " partial")
                self._record(system, "partial", "load", partial_load, rep)
        self._forget(prefix, system)

    def tune(self) -> tuple[int, int]:
        """Each candidate (part MiB, concurrency) saves and loads the large state once."""
        best: tuple[float, tuple[int, int]] | None = None
        for part, conc in _SWEEP:
            self._set_tuned(part, conc)
            prefix = f"{self.root}/sweep-{part}-{conc}"
            saved = self._child(
                self._spec("save", "s3ckpt-tuned", "large", prefix), "sweep", counts=False
            )
            load = self._spec("load", "s3ckpt-tuned", "large", f"{prefix}/ckpt")
            loaded = self._child(load, "sweep", counts=False) if saved else None
            self._forget(prefix, "raw")
            if saved and loaded:
                total = saved["seconds"] + loaded["seconds"]
                self.sweep.append(
                    {"part_mib": part, "concurrency": conc, "save_s": saved["seconds"]}
                    | {"load_s": loaded["seconds"], "total_s": total}
                )
                print(
                    f"  sweep part {part} MiB x {conc}: save {saved['seconds']:.2f} s,"
                    f" load {loaded['seconds']:.2f} s",
                    flush=True,
                )
                if best is None or total < best[0]:
                    best = (total, (part, conc))
        chosen = best[1] if best else _TUNED
        self._set_tuned(*chosen)
        return chosen

    def _set_tuned(self, part: int, concurrency: int) -> None:
        self.tuned = (part, concurrency)
        tuned = {"tuned_part_size": part * MiB, "tuned_concurrency": concurrency}
        self.direct = dataclasses.replace(self.direct, **tuned)  # type: ignore[arg-type]
        self.target = dataclasses.replace(self.target, **tuned)  # type: ignore[arg-type]


def _merge_ranks(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """A multi-rank save: the slowest rank's time, CPU and memory summed over ranks."""
    return {
        "seconds": max(r["seconds"] for r in ranks),
        "bytes": ranks[0]["bytes"],
        "tensors": ranks[0]["tensors"],
        "cpu_s": sum(r["cpu_s"] for r in ranks),
        "cpu_user_s": sum(r["cpu_user_s"] for r in ranks),
        "cpu_sys_s": sum(r["cpu_sys_s"] for r in ranks),
        "rss_extra": sum(r["rss_extra"] for r in ranks),
        "wire": ranks[0]["wire"],
        "stall_s": None,
    }


@contextlib.contextmanager
def server(args: argparse.Namespace) -> Iterator[Endpoint]:
    """The endpoint: given, a throwaway SeaweedFS, or Ceph RGW via benchmarks/ceph/*.sh."""
    if args.endpoint_url or args.server == "seaweedfs":
        with options.endpoint(args) as ep:
            yield ep
        return
    was_up = (
        subprocess.run(
            ["curl", "-s", "-o", "/dev/null", "--max-time", "2", "http://127.0.0.1:7480/"],
            check=False,
        ).returncode
        == 0
    )
    out = subprocess.run(
        [str(_CEPH / "start_ceph.sh")], capture_output=True, text=True, timeout=300, check=False
    )
    if out.returncode != 0:
        raise SystemExit(f"start_ceph.sh failed ({out.returncode}):\n{out.stderr[-3000:]}")
    found = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    version = subprocess.run(["ceph", "--version"], capture_output=True, text=True, check=False)
    name = "Ceph RGW " + (version.stdout.split()[2] if version.stdout else "?") + " single node"
    try:
        yield Endpoint(
            found["CEPH_S3_ENDPOINT"],
            found["CEPH_S3_ACCESS_KEY"],
            found["CEPH_S3_SECRET_KEY"],
            args.region,
            server=name,
        )
    finally:
        if not was_up and not args.keep_ceph:
            subprocess.run([str(_CEPH / "stop_ceph.sh")], check=False, timeout=120)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    started, machine = time.time(), machine_info()
    with server(args) as ep, contextlib.ExitStack() as stack:
        proxy = None if args.no_proxy else stack.enter_context(CountingProxy(ep.url))
        bench = PeerBench(args, ep, proxy.url if proxy else None)
        print(
            f"s3ckpt vs peers: large {args.size_gib:g} GiB, small {args.small_count} tensors,"
            f" {args.repeat} repetition(s), {ep.server} at {ep.url}"
            + (f" via counting proxy {proxy.url}" if proxy else ""),
            flush=True,
        )
        try:
            bench.prepare()
            if args.tuned == "auto":
                print("tuning s3ckpt (large state, one save and load each):", flush=True)
                print(f"  chose part {bench.tune()[0]} MiB x {bench.tuned[1]}", flush=True)
            bench.run()
        finally:
            bench.close()
    report = chart.report(bench, args, machine, ep, started)
    write_json(args.json, report)
    print(chart.text(report))
    if chart.plot(report, args.chart):
        print(f"chart: {args.chart}")
    print(f"JSON: {args.json}")
    for failure in bench.failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if bench.failures else 0


if __name__ == "__main__":
    sys.exit(main())
