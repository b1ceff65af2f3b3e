"""Run s3ckpt's coroutines from synchronous code.

DCP calls storage layers synchronously, from the main thread (``dcp.save``), from an executor thread
(``async_save`` THREAD mode), from a spawned process (PROCESS mode) and sometimes from code that
already runs an event loop, where ``asyncio.run`` fails. So all of s3ckpt's I/O runs on one private
event loop per process, on a daemon thread started on first use. Clients and semaphores live on that
loop, which is why one concurrency bound holds per process. After ``fork`` the child starts a fresh
loop; at interpreter exit registered closers run (closing HTTP sessions) before the loop stops.

On Linux the loop's thread, and the worker threads it starts (they inherit it), run at a lower
priority than training: ``nice`` +10 by default, ``S3CKPT_IO_NICE`` to change it (0: off). The
storage layer then never preempts a training step that wants the core (measured on one shared
core: from no difference beyond noise to half the time lost, `benchmarks/bench_training.py`
against mode ``thread-nice0``). Uploads only slow down when every core is busy with other work.
``S3CKPT_IO_CPUS`` (a list such as ``3`` or ``2,3`` or ``2-3``) pins those threads to cores that
training does not use, where a machine has them; unset, they run wherever the process may.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import os
import sys
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

from ..errors import ConfigError

__all__ = ["gather_or_cancel", "on_shutdown", "run", "submit"]

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
_closers: list[Callable[[], Awaitable[None]]] = []
_IO_NICE = 10


def _get_loop() -> asyncio.AbstractEventLoop:
    global _loop, _thread
    with _lock:
        if _loop is None:
            # Read here: a bad value must fail the caller, not kill the loop thread.
            nice, cpus = _io_nice(), _io_cpus()
            loop = asyncio.new_event_loop()
            thread = threading.Thread(
                target=_serve, args=(loop, nice, cpus), name="s3ckpt-io", daemon=True
            )
            thread.start()
            _loop, _thread = loop, thread
        return _loop


def _io_nice() -> int:
    text = os.environ.get("S3CKPT_IO_NICE", "").strip() or str(_IO_NICE)
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"S3CKPT_IO_NICE must be an integer (0: off), got {text!r}") from None


def _io_cpus() -> set[int] | None:
    text = os.environ.get("S3CKPT_IO_CPUS", "").strip()
    if not text:
        return None
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except ValueError:
        message = f"S3CKPT_IO_CPUS must list cores (e.g. 2,3 or 2-3), got {text!r}"
        raise ConfigError(message) from None
    return cpus


def _serve(loop: asyncio.AbstractEventLoop, nice: int, cpus: set[int] | None) -> None:
    try:
        _lower_priority(nice)
        if cpus and hasattr(os, "sched_setaffinity"):
            with contextlib.suppress(OSError):  # cores this process may not use
                os.sched_setaffinity(threading.get_native_id(), cpus)
    finally:
        loop.run_forever()


def _lower_priority(nice: int) -> None:
    """This thread (a Linux task of its own) ``nice`` steps below the process's priority."""
    if nice <= 0 or not hasattr(os, "setpriority") or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))


def submit(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Schedule ``coro`` on the private loop and return at once."""
    if threading.current_thread() is _thread:
        coro.close()
        raise RuntimeError("s3ckpt's blocking API was called from its own I/O thread (deadlock)")
    return asyncio.run_coroutine_threadsafe(coro, _get_loop())


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the private loop and wait; an interrupt cancels it (so uploads abort)."""
    future = submit(coro)
    try:
        return future.result()
    except BaseException:
        future.cancel()
        raise


def on_shutdown(closer: Callable[[], Awaitable[None]]) -> None:
    """Register a coroutine function to await on the loop when the interpreter exits."""
    _closers.append(closer)


def _shutdown() -> None:
    global _loop
    loop = _loop
    if loop is None or not loop.is_running():
        return

    async def close_all() -> None:
        await asyncio.gather(*(closer() for closer in _closers), return_exceptions=True)

    with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
        asyncio.run_coroutine_threadsafe(close_all(), loop).result(timeout=10)
    loop.call_soon_threadsafe(loop.stop)
    _loop = None


def _reset_after_fork() -> None:
    # The parent's loop thread does not exist in the child; its clients belong to the parent.
    global _loop, _thread, _lock
    _loop, _thread, _lock = None, None, threading.Lock()
    _closers.clear()


atexit.register(_shutdown)
os.register_at_fork(after_in_child=_reset_after_fork)


async def gather_or_cancel(aws: Iterable[Awaitable[T]]) -> list[T]:
    """Like ``asyncio.gather``, but the first failure cancels the rest and waits for them."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
