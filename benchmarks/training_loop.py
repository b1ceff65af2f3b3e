"""The loop `bench_training` times: a model, AdamW, and a checkpoint every N steps.

Imported by the child process after it pinned itself to its core, so that torch's threads
inherit the pinning.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import (
    AsyncCheckpointerType,
    async_save,
    save,
)

from s3ckpt import S3Config, S3Writer

from .raw import RawClient

__all__ = ["PEER_MODES", "run"]

# Peers' DCP writers, timed like THREAD mode (async_save).
PEER_MODES = ("s3torchconnector", "fsspec")


def _peer_writer(mode: str, config: S3Config, bucket: str) -> Any:
    """A peer's writer; peers take the endpoint and keys from the environment only."""
    from . import peers

    resolved = config.resolve()
    target = peers.Target(
        endpoint_url=str(config.endpoint_url),
        access_key_id=str(config.access_key_id),
        secret_access_key=str(config.secret_access_key),
        region=resolved.region,
        bucket=bucket,
        local_dir="",
        tuned_part_size=config.part_size,
        tuned_concurrency=config.max_concurrency,
    )
    os.environ.update(peers.peer_env(target))
    return peers.adapter(mode, target).writer()


class _Mlp(nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        for _ in range(layers):
            blocks += [nn.Linear(width, width), nn.GELU()]
        self.body = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(x)
        return out


class _Gpt(nn.Module):
    """A small decoder-only transformer (causal self-attention blocks)."""

    def __init__(self, width: int, layers: int, vocab: int = 8192, context: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        layer = nn.TransformerEncoderLayer(
            width, nhead=max(1, width // 64), dim_feedforward=4 * width, batch_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        out: torch.Tensor = self.head(self.blocks(x, mask=self.mask, is_causal=True))
        return out


def _model(args: argparse.Namespace) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    """The model and one training step's loss (fixed synthetic data: no loader to measure)."""
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(0)
    if args.model == "mlp":
        mlp = _Mlp(args.width, args.layers).to(device)
        x = torch.randn(args.batch, args.width, generator=generator).to(device)
        y = torch.randn(args.batch, args.width, generator=generator).to(device)
        return mlp, lambda: nn.functional.mse_loss(mlp(x), y)
    gpt = _Gpt(args.width, args.layers).to(device)
    tokens = torch.randint(0, 8192, (args.batch, 129), generator=generator).to(device)

    def loss() -> torch.Tensor:
        logits = gpt(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    return gpt, loss


class _Raw:
    """The floor: copy into kept CPU buffers, upload them with one plain aiobotocore client
    that lives on its own loop thread (as s3ckpt's does)."""

    def __init__(self, config: S3Config, bucket: str) -> None:
        self.bucket = bucket
        self.buffers: dict[str, torch.Tensor] = {}
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.client = RawClient(config)
        self._submit(self.client.__aenter__()).result()
        self.pending: concurrent.futures.Future[float] | None = None

    def _submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def save(self, state: dict[str, Any], prefix: str) -> None:
        for name, tensor in _tensors(state).items():
            buffer = self.buffers.get(name)
            if buffer is None:
                buffer = self.buffers[name] = torch.empty_like(tensor, device="cpu")
            buffer.copy_(tensor)
        views = {
            f"{prefix}/{name}": memoryview(b.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
            for name, b in self.buffers.items()
        }
        self.pending = self._submit(self.client.upload(self.bucket, views))

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None


def _tensors(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    if isinstance(state, dict):
        out: dict[str, torch.Tensor] = {}
        for k, v in state.items():
            out |= _tensors(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    return {}


def _cpu_seconds() -> float:
    """This process and its children (PROCESS mode's checkpointer), all threads."""
    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += sum(child.cpu_times()[:2])
    return float(total)


def _thread_cpu() -> tuple[float, float]:
    """CPU seconds of the main (training) thread, and of all other threads of this process."""
    main = threading.main_thread().native_id
    main_s = other_s = 0.0
    for thread in psutil.Process().threads():
        if thread.id == main:
            main_s += thread.user_time + thread.system_time
        else:
            other_s += thread.user_time + thread.system_time
    return main_s, other_s


def _tasks() -> dict[int, tuple[str, float]]:
    """Each live thread's name (Python's, without a pool's ``_N``) and CPU seconds, from
    /proc/self/task (all on the trainer's core: the process is pinned there)."""
    names = {t.native_id: t.name.rstrip("0123456789").rstrip("_-") for t in threading.enumerate()}
    names[threading.main_thread().native_id] = "training (main)"
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, float]] = {}
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/stat") as stat:
            text = stat.read()
        fields = text[text.rindex(")") + 2 :].split()
        comm = text[text.index("(") + 1 : text.rindex(")")]
        out[int(task)] = (names.get(int(task), comm), (int(fields[11]) + int(fields[12])) / ticks)
    return out


def _by_thread(before: dict[int, tuple[str, float]], own_cpu_s: float) -> dict[str, float]:
    """CPU seconds per thread name since ``before``; threads that ended meanwhile (DCP's
    executor, for one) are what the process's own CPU holds beyond the live ones."""
    out: dict[str, float] = {}
    for tid, (name, seconds) in _tasks().items():
        spent = seconds - before.get(tid, (name, 0.0))[1]
        out[name] = out.get(name, 0.0) + spent
    out["(threads that ended)"] = max(0.0, own_cpu_s - sum(out.values()))
    return {name: seconds for name, seconds in out.items() if seconds > 0}


def _own_cpu_seconds() -> float:
    return float(sum(psutil.Process().cpu_times()[:2]))


def _core_times(core: int) -> dict[str, float]:
    """Seconds the core spent in user, system, softirq and irq (from /proc/stat)."""
    ticks = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as stat:
        for line in stat:
            name, *values = line.split()
            if name == f"cpu{core}":
                user, nice, system, _, _, irq, softirq = (int(v) for v in values[:7])
                return {
                    "user": (user + nice) / ticks,
                    "system": system / ticks,
                    "irq": (irq + softirq) / ticks,
                }
    return {}


def run(args: argparse.Namespace, config: S3Config) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    mode, interval, checkpoints = args.child, args.interval, args.checkpoints
    with tempfile.TemporaryDirectory() as directory:
        dist.init_process_group("gloo", init_method=f"file://{directory}/pg", rank=0, world_size=1)
        try:
            return _timed(args, config, mode, interval, checkpoints)
        finally:
            dist.destroy_process_group()


def _timed(
    args: argparse.Namespace, config: S3Config, mode: str, interval: int, checkpoints: int
) -> dict[str, Any]:
    model, loss_of = _model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        loss = loss_of()
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()

    for _ in range(3):  # optimizer state exists, caches are warm
        step()
    run_url = f"s3://{args.bucket}/{mode}-{os.getpid()}-{interval}"
    first = ("thread-first", "thread-prepared")  # a job's first checkpoints: no warm-up save
    s3ckpt_async = ("thread", "thread-nice0", *first, "thread-io", "process")
    writer: Any = S3Writer(run_url, config=config) if mode in s3ckpt_async else None
    if mode in PEER_MODES:
        writer = _peer_writer(mode, config, args.bucket)
    raw = _Raw(config, args.bucket) if mode == "raw" else None
    kind = AsyncCheckpointerType.PROCESS if mode == "process" else AsyncCheckpointerType.THREAD
    pending: Any = None
    blocking = 0.0
    blocked: list[float] = []  # each checkpoint's blocking (the last one's with the final wait)

    def checkpoint(name: str) -> None:
        nonlocal pending, blocking
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        began = time.perf_counter()
        if mode == "sync":
            save(state, storage_writer=S3Writer(f"{run_url}/{name}", config=config))
        elif raw is not None:
            raw.wait()
            raw.save(state, f"{mode}-{os.getpid()}/{name}")
        elif writer is not None:
            if pending is not None:
                pending.result()
            pending = async_save(
                state,
                checkpoint_id=f"{run_url}/{name}",
                storage_writer=writer,
                async_checkpointer_type=kind,
            )
        blocked.append(time.perf_counter() - began)
        blocking += blocked[-1]

    def in_flight_now() -> bool:
        if raw is not None:
            return raw.pending is not None and not raw.pending.done()
        return pending is not None and not pending.done()

    def durable() -> None:
        nonlocal blocking
        began = time.perf_counter()
        if pending is not None:
            pending.result()
        if raw is not None:
            raw.wait()
        waited = time.perf_counter() - began
        blocking += waited
        if blocked:
            blocked[-1] += waited

    if mode == "thread-prepared":
        model_state, optim_state = get_state_dict(model, optimizer)
        writer.prepare_staging({"model": model_state, "optim": optim_state})
    elif mode not in ("none", *first):
        checkpoint("warm-up")
        durable()
    blocking = 0.0
    blocked.clear()
    model_state, optim_state = get_state_dict(model, optimizer)
    tensors = _tensors({"model": model_state, "optim": optim_state}).values()
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    threads_before, core_before = _thread_cpu(), _core_times(args.trainer_core)
    tasks_before, own_before = _tasks(), _own_cpu_seconds()
    cpu_before, started = _cpu_seconds(), time.perf_counter()
    steps = interval * (checkpoints + 1)
    durations: list[float] = []
    busy: list[bool] = []  # a save was in flight while the step ran
    for number in range(1, steps + 1):
        began = time.perf_counter()
        in_flight = in_flight_now()
        step()
        if args.device != "cpu":
            torch.cuda.synchronize()
        durations.append(time.perf_counter() - began)
        busy.append(in_flight or in_flight_now())
        if mode != "none" and number % interval == 0 and number // interval <= checkpoints:
            checkpoint(f"step-{number}")
    durable()
    wall = time.perf_counter() - started
    cpu = _cpu_seconds() - cpu_before
    by_thread = _by_thread(tasks_before, _own_cpu_seconds() - own_before)
    threads_after, core_after = _thread_cpu(), _core_times(args.trainer_core)
    core = {k: core_after[k] - core_before.get(k, 0.0) for k in core_after}
    # The machine's speed drifts between runs by more than a checkpoint costs; within a run, a
    # step without a save in flight (the whole first interval is one) is the baseline.
    clean = statistics.median(d for d, b in zip(durations, busy, strict=True) if not b)
    slowed = sum(d - clean for d, b in zip(durations, busy, strict=True) if b)
    # Each checkpoint's share: its blocking, and the slowing of the steps after it (until the
    # next), so that a job's first checkpoint is compared with its later ones in the same run.
    by_checkpoint = list(blocked)
    for number, (duration, was_busy) in enumerate(zip(durations, busy, strict=True), start=1):
        after = min((number - 1) // interval, len(by_checkpoint))
        if was_busy and after:
            by_checkpoint[after - 1] += duration - clean
    return {
        "in_run_lost_s": blocking + slowed,
        "lost_by_checkpoint_s": by_checkpoint,
        "main_thread_cpu_s": threads_after[0] - threads_before[0],
        "other_threads_cpu_s": threads_after[1] - threads_before[1],
        "thread_cpu_s": by_thread,
        "core_s": core,
        "slowed_s": slowed,
        "clean_step_s": clean,
        "busy_steps": sum(busy),
        "mode": mode,
        "wall_s": wall,
        "blocking_s": blocking,
        "cpu_s": cpu,
        "steps": steps,
        "step_s": wall / steps,
        "checkpoints": checkpoints if mode != "none" else 0,
        "state_bytes": state_bytes,
    }
