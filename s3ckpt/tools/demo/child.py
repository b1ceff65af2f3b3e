"""A training process as the demo sees it: started, listened to, and perhaps killed."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from ...format.layout import step_name

__all__ = ["Child", "DemoError"]


class DemoError(Exception):
    """The demo could not stage what it meant to show (a run failed, the kill came too late)."""


class Child:
    """One ``python -m s3ckpt.tools.demo --child train`` process and the events it has reported.

    Iterating yields its events as they arrive (echoed as progress lines unless ``quiet``) and
    ends when the process closes its stdout, at exit or death.
    """

    def __init__(
        self, role: str, argv: list[str], env: dict[str, str], *, quiet: bool = False
    ) -> None:
        self.role = role
        self.quiet = quiet
        self.events: list[dict[str, Any]] = []
        self.spawned = time.time()
        self.ended: float | None = None
        self.killed_at: float | None = None
        command = [sys.executable, "-m", "s3ckpt.tools.demo", "--child", "train", *argv]
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            event = json.loads(line)
            self.events.append(event)
            if not self.quiet:
                self._echo(event)
            yield event

    def finish(self) -> None:
        """Read to the end and reap; a run that failed by itself (not killed) is an error."""
        for _ in self:
            pass
        code = self.proc.wait()
        self.ended = time.time()
        if code != 0 and self.killed_at is None:
            raise DemoError(f"the {self.role} run exited with status {code} (its error is above)")

    def kill(self) -> None:
        """SIGKILL: no handler, no atexit, no abort of its uploads — a crashed node."""
        self.proc.send_signal(signal.SIGKILL)
        self.killed_at = time.time()

    def stop(self) -> None:
        """Make sure the process is gone (when the demo itself fails)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [event for event in self.events if event["event"] == kind]

    def _echo(self, event: dict[str, Any]) -> None:
        kind, tag = event["event"], f"  [{self.role}]"
        if kind == "resume":
            load = event["t1"] - event["t0"]
            print(
                f"{tag} mgr.restore loaded the newest committed checkpoint, {event['url']}; "
                f"resuming after step {event['step']} (load {load:.2f} s)"
            )
        elif kind == "save":
            loss = self.of("step")[-1]["loss"]
            stall = (event["t1"] - event["t0"]) * 1e3
            print(
                f"{tag} step {event['step']:4d}  loss {loss:.4f}  mgr.save: "
                f"{step_name(event['step'])} started; training blocked {stall:.0f} ms"
            )
        elif kind == "saved":
            save = next(e for e in self.of("save") if e["step"] == event["step"])
            upload = event["t"] - save["t1"]
            print(f"{tag} {step_name(event['step'])} committed after a {upload:.2f} s upload")
        sys.stdout.flush()
