"""What `CheckpointManager` costs: per save against a bare ``dcp.async_save``, and continuous=True.

``python -m benchmarks.bench_manager`` (a local SeaweedFS unless ``--endpoint-url``; about three
minutes). The trainer (this process, one torch thread) is pinned to one core and the local server
to another, as in `bench_training`. Every case trains the same MLP with AdamW and checkpoints the
same state (model and optimizer) every ``--interval`` steps; the cases run interleaved, every
case once per repetition, and medians are reported.

Per save, three ways to save the same state:

- ``bare``: ``dcp.async_save`` through one reused `S3Writer`, waiting for the previous save first
  (what the manager does, by hand);
- ``manager``: ``mgr.save(step, state)`` on every step, which saves every ``--interval``-th
  (no retention: ``keep_last=None``);
- ``manager+keep``: the same with ``keep_last=2``: after each commit the coordinator lists the run
  and deletes what falls out.

For each: the training loop's wall time for ``--saves`` checkpoints and the last one's wait
(``loop s``; ``+ms/save``: its difference to ``bare``'s over ``--saves``), the time the save
call blocks training (``stall ms``), and a save started and waited for at once (``durable ms``,
which for ``manager+keep`` includes its retention), each with its difference to ``bare``.

Continuous: ``every`` (``continuous=False``) against ``continuous=True`` (a save whenever none is
in flight) in the same loop. Lost is the checkpointed phase's wall time minus its steps at the
clean step time of the same run (steps before any save), so drift between runs cancels out.

Results: a table per part and ``benchmarks/results/manager.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import async_save

from s3ckpt import CheckpointManager, S3Config, S3Writer, SavePolicy
from s3ckpt.engine import bridge
from s3ckpt.engine.store import get_store
from s3ckpt.tools import catalog

from . import options
from .common import MiB, format_table, machine_info, median, pin_threads, s3_endpoint

SAVE_CASES = ("bare", "manager", "manager+keep")
LOOP_CASES = ("every", "continuous")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = options.Parser(__file__, __doc__)
    count = options.positive_int
    p.add_argument("--width", type=count, default=1024, help="MLP width (1024: 50 MB of state)")
    p.add_argument("--layers", type=count, default=4)
    p.add_argument("--batch", type=count, default=64)
    p.add_argument("--interval", type=count, default=40, help="steps between checkpoints")
    p.add_argument("--saves", type=count, default=5, help="checkpoints per timed loop")
    p.repeat(3)
    p.cores()
    p.server(bucket="bench-manager-")
    p.json("manager.json")
    return p.parse(argv)


class Trainer:
    """The MLP, its optimizer and one step; `state` holds references to their tensors, so one
    dict built after the first steps stays current (AdamW updates in place)."""

    def __init__(self, args: argparse.Namespace) -> None:
        generator = torch.Generator().manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(args.layers):
            layers += [nn.Linear(args.width, args.width), nn.GELU()]
        self.model = nn.Sequential(*layers)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(args.batch, args.width, generator=generator)
        self.y = torch.randn(args.batch, args.width, generator=generator)
        for _ in range(3):  # the optimizer's state exists, caches are warm
            self.step()
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        self.state: dict[str, Any] = {"model": model_state, "optim": optim_state}

    def step(self) -> float:
        """One training step; its duration in seconds."""
        began = time.perf_counter()
        loss = nn.functional.mse_loss(self.model(self.x), self.y)
        self.optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()
        return time.perf_counter() - began

    def state_bytes(self) -> int:
        tensors = [*self.model.parameters()]
        tensors += [t for s in self.optimizer.state.values() for t in s.values()]
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class Saver:
    """One case's way to save: start a save (None: nothing started) and wait for the last."""

    def __init__(self, case: str, url: str, config: S3Config, interval: int) -> None:
        self.case = case
        self.url = url
        self.manager: CheckpointManager | None = None
        self.writer: S3Writer | None = None
        self.pending: Future[Any] | None = None
        if case == "bare":
            self.writer = S3Writer(url, config=config)
        else:
            keep = 2 if case in ("manager+keep", "every", "continuous") else None
            saving = SavePolicy(every=interval, continuous=case == "continuous")
            self.manager = CheckpointManager(url, keep_last=keep, saving=saving, config=config)
        self.interval = interval

    def save(self, step: int, state: dict[str, Any], *, force: bool = False) -> bool:
        if self.manager is not None:
            return self.manager.save(step, state, force=force)
        if step % self.interval and not force:
            return False
        assert self.writer is not None
        if self.pending is not None:
            self.pending.result()
        future = async_save(
            state, checkpoint_id=f"{self.url}/step-{step:09d}", storage_writer=self.writer
        )
        assert isinstance(future, Future)  # S3Writer stages at once: no AsyncSaveResponse
        self.pending = future
        return True

    def durable(self, step: int, state: dict[str, Any]) -> None:
        """Save ``step`` and wait until it has committed (and the manager's retention ran)."""
        self.save(step, state)
        self.wait()

    def wait(self) -> None:
        if self.manager is not None:
            self.manager.wait()
        elif self.pending is not None:
            self.pending.result()
            self.pending = None

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()
        elif self.writer is not None:
            self.wait()
            self.writer.close()


def _timed(call: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    began = time.perf_counter()
    result = call(*args)
    return result, time.perf_counter() - began


def save_case(
    args: argparse.Namespace, trainer: Trainer, config: S3Config, case: str, rep: int
) -> dict[str, Any]:
    """``--saves`` checkpoints of a training loop, then ``--saves`` saves each waited for."""
    url = f"s3://{args.bucket}/{case}-{rep}"
    saver = Saver(case, url, config, args.interval)
    try:
        saver.save(0, trainer.state, force=True)  # warm buffers and client, as in a long job
        saver.wait()
        stalls: list[float] = []
        began = time.perf_counter()
        last = args.interval * args.saves
        for step in range(1, last + 1):
            trainer.step()
            started, stall = _timed(saver.save, step, trainer.state)
            if started:
                stalls.append(stall)
        saver.wait()
        loop = time.perf_counter() - began
        durable = []
        for n in range(1, args.saves + 1):
            step = last + n * args.interval
            _, took = _timed(saver.durable, step, trainer.state)
            durable.append(took)
    finally:
        saver.close()
    kept = [i.step for i in catalog.list_checkpoints(url, config) if i.committed]
    return {
        "case": case,
        "loop_s": loop,
        "stall_s": stalls,
        "durable_s": durable,
        "saves": len(stalls),
        "kept": kept,
    }


def loop_case(
    args: argparse.Namespace, trainer: Trainer, config: S3Config, case: str, rep: int
) -> dict[str, Any]:
    """Clean steps first (the run's own baseline), then the same number of steps times
    ``--saves`` with the manager saving by its policy, then its wait."""
    url = f"s3://{args.bucket}/{case}-{rep}"
    saver = Saver(case, url, config, args.interval)
    try:
        saver.save(0, trainer.state, force=True)
        saver.wait()
        clean = statistics.median(trainer.step() for _ in range(2 * args.interval))
        steps = args.interval * args.saves
        started = blocking = 0.0
        began = time.perf_counter()
        for step in range(1, steps + 1):
            trainer.step()
            saved, stall = _timed(saver.save, step, trainer.state)
            started += saved
            blocking += stall
        _, waited = _timed(saver.wait)
        wall = time.perf_counter() - began
    finally:
        saver.close()
    return {
        "case": case,
        "wall_s": wall,
        "clean_step_s": clean,
        "lost_s": wall - steps * clean,
        "lost_fraction": (wall - steps * clean) / (steps * clean),
        "blocking_s": blocking + waited,
        "saves": int(started),
        "steps": steps,
    }


def summarize_saves(runs: dict[str, list[dict[str, Any]]], saves: int) -> dict[str, Any]:
    """Medians per case, and each one's difference to ``bare``: per save of the loop (its wall
    time over ``saves``), in the stall, and in the time to durable."""

    def medians(results: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "loop_s": median([r["loop_s"] for r in results]),
            "stall_ms": median([s * 1e3 for r in results for s in r["stall_s"]]),
            "durable_ms": median([d * 1e3 for r in results for d in r["durable_s"]]),
        }

    bare = medians(runs["bare"])
    out: dict[str, Any] = {}
    for case, results in runs.items():
        mine = medians(results)
        loop = _minus(mine["loop_s"], bare["loop_s"])
        out[case] = mine | {
            "loop_ms_per_save_vs_bare": None if loop is None else loop / saves * 1e3,
            "stall_ms_vs_bare": _minus(mine["stall_ms"], bare["stall_ms"]),
            "durable_ms_vs_bare": _minus(mine["durable_ms"], bare["durable_ms"]),
            "loops": [r["loop_s"] for r in results],
            "kept": results[-1]["kept"],
        }
    return out


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def summarize_loops(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    return {
        case: {
            "lost_s": median([r["lost_s"] for r in results]),
            "lost_fraction": median([r["lost_fraction"] for r in results]),
            "blocking_s": median([r["blocking_s"] for r in results]),
            "saves": median([r["saves"] for r in results]),
            "clean_step_s": median([r["clean_step_s"] for r in results]),
            "steps": results[0]["steps"],
            "lost_all": [r["lost_s"] for r in results],
        }
        for case, results in runs.items()
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    machine = machine_info()
    with s3_endpoint(args.endpoint_url, args.access_key, args.secret_key, args.region) as ep:
        pinned = pin_threads(ep.server_pid, args.server_core)
        pinned = pin_threads(0, args.trainer_core) and pinned
        config = ep.config(part_size=16 * MiB, max_concurrency=8)
        bridge.run(get_store(config).create_bucket(args.bucket))
        trainer = Trainer(args)
        size = trainer.state_bytes()
        print(
            f"manager benchmark: MLP x{args.layers} width {args.width} ({size / 1e6:.0f} MB of "
            f"state), a checkpoint every {args.interval} steps, {args.saves} per loop, "
            f"{args.repeat} repetitions; {'pinned' if pinned else 'unpinned'}; {ep.server}",
            flush=True,
        )
        save_runs: dict[str, list[dict[str, Any]]] = {case: [] for case in SAVE_CASES}
        loop_runs: dict[str, list[dict[str, Any]]] = {case: [] for case in LOOP_CASES}
        for rep in range(args.repeat):
            for case in SAVE_CASES:
                result = save_case(args, trainer, config, case, rep)
                save_runs[case].append(result)
                print(f"  [{rep + 1}/{args.repeat}] {case:>12}: loop {result['loop_s']:.2f} s")
            for case in LOOP_CASES:
                result = loop_case(args, trainer, config, case, rep)
                loop_runs[case].append(result)
                print(
                    f"  [{rep + 1}/{args.repeat}] {case:>12}: {result['saves']} saves, lost "
                    f"{result['lost_s']:.2f} s",
                    flush=True,
                )
    saves = summarize_saves(save_runs, args.saves)
    loops = summarize_loops(loop_runs)
    columns = ["loop_s", "loop_ms_per_save_vs_bare", "stall_ms", "stall_ms_vs_bare"]
    columns += ["durable_ms", "durable_ms_vs_bare"]
    rows = [[case, *(numbers[k] for k in columns)] for case, numbers in saves.items()]
    headers = ["case", "loop s", "+ms/save", "stall ms", "+ms", "durable ms", "+ms"]
    print(format_table(headers, rows))
    print(
        "+ms: the difference to bare; +ms/save: of the loop's wall time, over its saves (within "
        "the drift between runs on a shared machine: see loops in the JSON)"
    )
    rows = [
        [c, n["saves"], n["lost_s"], f"{100 * n['lost_fraction']:.1f}%", n["blocking_s"]]
        for c, n in loops.items()
    ]
    print(format_table(["policy", "saves", "lost s", "lost", "blocking s"], rows))
    print(
        f"medians of {args.repeat}; {loops['every']['steps']} steps per loop at "
        f"{loops['every']['clean_step_s'] * 1e3:.0f} ms"
    )
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    report |= {"machine": machine}
    report |= {"state_bytes": size, "server_pinned": pinned, "per_save": saves, "loops": loops}
    report |= {"runs": {"per_save": save_runs, "loops": loop_runs}}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
