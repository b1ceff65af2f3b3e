"""Run s3ckpt's coroutines from synchronous code.

DCP calls storage layers synchronously, from the main thread (``dcp.save``), from an executor thread
(``async_save`` THREAD mode), from a spawned process (PROCESS mode) and sometimes from code that
already runs an event loop, where ``asyncio.run`` fails. So all of s3ckpt's I/O runs on one private
event loop per process, on a daemon thread started on first use. Clients and semaphores live on that
loop, which is why one concurrency bound holds per process. After ``fork`` the child starts a fresh
loop; at interpreter exit registered closers run (closing HTTP sessions) before the loop stops.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import torch.futures

__all__ = ["on_shutdown", "run", "submit", "to_torch_future"]

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
_closers: list[Callable[[], Awaitable[None]]] = []


def _get_loop() -> asyncio.AbstractEventLoop:
    global _loop, _thread
    with _lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="s3ckpt-io", daemon=True)
            thread.start()
            _loop, _thread = loop, thread
        return _loop


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


def to_torch_future(done: concurrent.futures.Future[T]) -> torch.futures.Future[T]:
    """A torch Future (what DCP waits on) that completes as ``done`` does."""
    future: torch.futures.Future[T] = torch.futures.Future()

    def complete(cf: concurrent.futures.Future[T]) -> None:
        error = concurrent.futures.CancelledError() if cf.cancelled() else cf.exception()
        if error is None:
            future.set_result(cf.result())
        else:
            future.set_exception(error)

    done.add_done_callback(complete)
    return future


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
