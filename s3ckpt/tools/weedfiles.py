"""The files a local SeaweedFS (`localserver.SeaweedFS`) runs with, none of them readable by
another local user: the data directory's S3 keys, and, for each start, everything weed reads.

On a shared machine every user can reach 127.0.0.1, so the ports are the boundary. S3 checks
SigV4 against keys made at random per data directory (``credentials``). The master, volume,
filer and admin servers, HTTP and gRPC alike, answer only a client certificate signed by a CA
made for this start, whose key never reaches the disk (`write_config`: mutual TLS, as
``security.toml`` allows); without it their HTTP APIs read and delete any object (master
``/col/delete`` drops a bucket's volumes).

weed looks for each of its toml files in its working directory, then ``$HOME/.seaweedfs``,
``/usr/local/etc/seaweedfs`` and ``/etc/seaweedfs``, and uses the first found; it runs with a
private directory as both, holding one of each, so no other file applies.
"""

from __future__ import annotations

import configparser
import datetime
import ipaddress
import json
import os
import secrets
from pathlib import Path
from typing import NamedTuple

__all__ = [
    "CONFIG_NAMES",
    "CREDENTIALS_FILE",
    "CREDENTIALS_PROFILE",
    "Credentials",
    "load_credentials",
    "new_credentials",
    "store_credentials",
    "write_config",
    "write_private",
]

CREDENTIALS_FILE = "credentials"
# The file is in the AWS shared-credentials format: AWS_SHARED_CREDENTIALS_FILE and AWS_PROFILE
# point any AWS SDK (and s3ckpt) at it, so the secret need not be printed again.
CREDENTIALS_PROFILE = "s3ckpt-local"
# What `weed scaffold -config=...` knows: every toml file weed may read.
CONFIG_NAMES = (
    "security",
    "filer",
    "master",
    "volume",
    "notification",
    "replication",
    "credential",
    "shell",
    "admin",
)
# Servers that require the client certificate (gRPC: also the clients among them), and those
# that also serve HTTP; S3 answers HTTP without it, behind SigV4.
_GRPC_COMPONENTS = ("master", "volume", "filer", "s3", "admin", "worker")
_HTTPS_COMPONENTS = ("master", "volume", "filer", "admin")
# Made at every start: the long validity only means a server never outlives its certificate.
_TLS_VALIDITY = datetime.timedelta(days=3650)
_TLS_NOT_BEFORE_SLACK = datetime.timedelta(minutes=5)
_PRIVATE_BITS = 0o077


class Credentials(NamedTuple):
    access_key_id: str
    secret_access_key: str


def write_private(path: Path, text: str) -> None:
    """Create ``path`` with mode 0600 from the first byte; O_EXCL: never through a file or link
    that was there before."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with open(fd, "w", encoding="utf-8") as f:
        f.write(text)


def new_credentials() -> Credentials:
    """Random keys (``secrets``): a server's are known only to whoever can read its files."""
    return Credentials(f"s3ckpt-{secrets.token_hex(8)}", secrets.token_urlsafe(30))


def load_credentials(workdir: Path) -> Credentials | None:
    """The keys stored in ``workdir``, None if there are none yet.

    A file another user owns or may read is refused: its keys may be known to someone else (or
    chosen by them, in a directory they can write to).
    """
    path = workdir / CREDENTIALS_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    with open(fd, encoding="utf-8") as f:
        stat = os.fstat(f.fileno())
        if stat.st_uid != os.getuid() or stat.st_mode & _PRIVATE_BITS:
            raise RuntimeError(
                f"{path} is not private to you (mode {stat.st_mode & 0o777:04o}, owner uid "
                f"{stat.st_uid}): others may know these keys; delete it to make new ones "
                "(the data stays)"
            )
        text = f.read()
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string(text)
        section = parser[CREDENTIALS_PROFILE]
        return Credentials(section["aws_access_key_id"], section["aws_secret_access_key"])
    except (configparser.Error, KeyError) as e:
        raise RuntimeError(
            f"{path} does not hold the [{CREDENTIALS_PROFILE}] keys s3ckpt writes ({e!r}); "
            "delete it to make new ones (the data stays)"
        ) from e


def store_credentials(workdir: Path, credentials: Credentials) -> Path:
    """Keep ``credentials`` for the next start of ``workdir``; FileExistsError if another start
    stored its own meanwhile."""
    path = workdir / CREDENTIALS_FILE
    write_private(
        path,
        "# The S3 keys of the local SeaweedFS that keeps its data in this directory (made by\n"
        "# s3ckpt on its first start). Keep this file private.\n"
        f"[{CREDENTIALS_PROFILE}]\n"
        f"aws_access_key_id = {credentials.access_key_id}\n"
        f"aws_secret_access_key = {credentials.secret_access_key}\n",
    )
    return path


def write_config(directory: Path, data: Path) -> None:
    """Every toml file weed may read, and the TLS material ``security.toml`` names, into
    ``directory`` (weed's working directory and HOME); ``data`` is weed's ``-dir``.

    ``filer.toml`` names the store weed mini would choose itself (leveldb2 in ``data``), so data
    directories of earlier starts stay readable; the others are empty.
    """
    ca, cert, key = _write_tls(directory)
    own: dict[str, object] = {"cert": cert, "key": key}
    security: dict[str, dict[str, object]] = {"grpc": {"ca": ca}}
    security |= {f"grpc.{name}": own for name in _GRPC_COMPONENTS}
    security["grpc.client"] = own
    security["https.client"] = {"enabled": True, **own, "ca": ca}
    security |= {f"https.{name}": {**own, "ca": ca} for name in _HTTPS_COMPONENTS}
    filer: dict[str, dict[str, object]] = {"leveldb2": {"enabled": True, "dir": data / "filerldb2"}}
    for name in CONFIG_NAMES:
        sections = {"security": security, "filer": filer}.get(name, {})
        write_private(directory / f"{name}.toml", _toml(name, sections))


def _toml(name: str, sections: dict[str, dict[str, object]]) -> str:
    lines = [f"# {name}.toml, written by s3ckpt for one start of weed (s3ckpt/tools/weedfiles.py)"]
    for section, values in sections.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            text = str(value).lower() if isinstance(value, bool) else _toml_string(str(value))
            lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"


def _toml_string(text: str) -> str:
    """A TOML basic string: JSON's escapes are TOML's (non-ASCII stays raw, as surrogate-pair
    escapes are not TOML)."""
    return json.dumps(text, ensure_ascii=False)


def _write_tls(directory: Path) -> tuple[Path, Path, Path]:
    """A CA made now, and one certificate it signs for every component, as server and client;
    the CA's key stays in memory, so no one can get another certificate the components accept."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError as e:
        raise RuntimeError(
            "the local server needs the cryptography package for its certificates; "
            "install it with: pip install 's3ckpt[local]'"
        ) from e

    now = datetime.datetime.now(datetime.timezone.utc)

    def builder(
        subject: str, issuer: str, key: ec.EllipticCurvePrivateKey
    ) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _TLS_NOT_BEFORE_SLACK)
            .not_valid_after(now + _TLS_VALIDITY)
        )

    ca_name, node_name = "s3ckpt local SeaweedFS CA", "s3ckpt local SeaweedFS"
    ca_key = ec.generate_private_key(ec.SECP256R1())
    node_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        builder(ca_name, ca_name, ca_key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    loopback = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    node = (
        builder(node_name, ca_name, node_key)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(loopback), critical=False)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    paths = directory / "ca.crt", directory / "node.crt", directory / "node.key"
    write_private(paths[0], ca.public_bytes(pem).decode())
    write_private(paths[1], node.public_bytes(pem).decode())
    key_pem = node_key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    write_private(paths[2], key_pem.decode())
    return paths
