"""The command-line options the benchmarks share, each defined once: the same name, default and
help in every benchmark that takes it. A benchmark adds the ones it takes and keeps its own flags
local::

    p = options.Parser(__file__, __doc__)
    p.add_argument("--count", type=options.positive_int, default=1000, help="...")  # its own
    p.repeat(3)                     # --repeat
    p.server()                      # --endpoint-url --access-key --secret-key --region --bucket
    p.json("catalog.json")          # --json
    args = p.parse(argv)
    with options.endpoint(args) as ep: ...

`Parser.parse` then fills in the defaults that depend on other flags: under ``--quick`` every
option added by `Parser.scaled` (``--repeat``, ``--size-gib`` or a benchmark's own sizes) takes
its quick value unless given, and the JSON goes to ``NAME-quick.json`` (a smoke run does not
overwrite a real run's figures) unless ``--json`` says where.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
from pathlib import Path
from typing import Any

from s3ckpt.config import MiB, S3Config

from .common import RESULTS, ROOT, Endpoint, s3_endpoint

__all__ = ["Parser", "endpoint", "positive_float", "positive_int"]

_DEFAULTS = S3Config()


def positive_int(text: str) -> int:
    """An argparse type: a whole number of 1 or more."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a number over 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be over 0, not {text}")
    return value


def _shown(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(map(_shown, value))
    return f"{value:g}" if isinstance(value, float) else str(value)


class Parser(argparse.ArgumentParser):
    """A benchmark's parser: ``python -m benchmarks.NAME``, the module's docstring as written
    (its example lines kept), and a method per shared option."""

    def __init__(self, file: str, doc: str | None) -> None:
        super().__init__(
            prog=f"python -m benchmarks.{Path(file).stem}",
            description=doc,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        self._scaled: dict[str, tuple[Any, Any]] = {}  # dest -> (default, under --quick)
        self._json: dict[str, str] = {}  # "" -> the JSON's name; a flag's dest -> its own
        self._quick = False

    def parse(self, argv: list[str] | None = None) -> argparse.Namespace:
        """`parse_args`, then the defaults that depend on other flags (see the module)."""
        args = self.parse_args(argv)
        quick = bool(getattr(args, "quick", False))
        for dest, (default, small) in self._scaled.items():
            if getattr(args, dest) is None:
                setattr(args, dest, small if quick else default)
        if self._json and args.json is None:
            variant = (name for dest, name in self._json.items() if dest and getattr(args, dest))
            args.json = RESULTS / next(variant, self._json[""])
        return args

    def scaled(self, flag: str, default: Any, quick: Any, help: str, **kwargs: Any) -> None:
        """An option whose default is ``default``, or ``quick`` under ``--quick`` (where that
        is not None)."""
        if quick is None:
            help += f" (default {_shown(default)})"
            self.add_argument(flag, default=default, help=help, **kwargs)
            return
        shown = f"default {_shown(default)}; --quick: {_shown(quick)}"
        action = self.add_argument(flag, default=None, help=f"{help} ({shown})", **kwargs)
        self._scaled[action.dest] = (default, quick)

    # --- what a run measures and reports

    def quick(self, what: str) -> None:
        """``--quick``: a smoke run at CI size; ``what`` it runs. Before `json`."""
        self.add_argument("--quick", action="store_true", help=f"a smoke run: {what}")
        self._quick = True

    def json(self, name: str, **variants: str) -> None:
        """``--json``: where the report goes; by default ``benchmarks/results/NAME``, or the
        name ``variants`` gives where its flag is set (``--quick``: ``NAME-quick``)."""
        if self._quick:
            path = Path(name)
            variants = {"quick": f"{path.stem}-quick{path.suffix}", **variants}
        self._json = {"": name, **variants}
        others = "".join(f"; --{d.replace('_', '-')}: {n}" for d, n in variants.items())
        help = f"where the JSON report goes (default benchmarks/results/{name}{others})"
        self.add_argument("--json", type=Path, metavar="PATH", help=help)

    def chart(self, default: Path, *aliases: str) -> None:
        """``--chart``: where the benchmark draws its chart (``aliases``: other names for it)."""
        help = f"where the chart goes (default {default.relative_to(ROOT)})"
        self.add_argument(
            "--chart", *aliases, type=Path, default=default, metavar="PATH", help=help
        )

    def repeat(self, default: int, quick: int | None = None, kept: str = "the medians") -> None:
        """``--repeat``: timed repetitions of every case, of which ``kept`` are reported."""
        help = f"timed repetitions of every case; {kept} are reported"
        self.scaled("--repeat", default, quick, help, type=positive_int, metavar="N")

    def seed(self) -> None:
        help = "seed of the random draws: tensor contents, faults..."
        self.scaled("--seed", 0, None, help, type=int, metavar="N")

    def size_gib(self, default: float, what: str, quick: float | None = None) -> None:
        """``--size-gib``: the size of ``what``."""
        help = f"size of the {what} in GiB"
        self.scaled("--size-gib", default, quick, help, type=positive_float, metavar="GIB")

    def timeout(self, default: str) -> None:
        """``--timeout-s``: a case's time limit, ``default`` unless given."""
        help = f"seconds a case may take before it fails (default {default})"
        self.add_argument("--timeout-s", type=positive_float, metavar="S", help=help)

    # --- where it runs

    def server(self, bucket: str = "s3ckpt-bench") -> None:
        """The S3 server: a throwaway local SeaweedFS, or ``--endpoint-url`` and its keys. A
        ``bucket`` ending in ``-`` is a fresh one per run: that, then 6 random hex digits."""
        group = self.add_argument_group("S3 server", "default: a throwaway local SeaweedFS")
        group.add_argument("--endpoint-url", metavar="URL", help="an S3 endpoint to use instead")
        group.add_argument("--access-key", metavar="KEY", help="with --endpoint-url")
        group.add_argument("--secret-key", metavar="KEY", help="with --endpoint-url")
        help = "default: the AWS sources, else us-east-1"
        group.add_argument("--region", metavar="NAME", help=help)
        fresh = bucket.endswith("-")
        help = f"created if missing (default {f'a fresh {bucket}XXXXXX' if fresh else bucket})"
        default = bucket + secrets.token_hex(3) if fresh else bucket
        group.add_argument("--bucket", metavar="NAME", default=default, help=help)

    def cores(self) -> None:
        """``--trainer-core`` and ``--server-core``: where this process and a local server are
        pinned, so that neither takes the other's core."""
        last = max(0, (os.cpu_count() or 2) - 1)
        help = "the core this process (the trainer, the client) is pinned to (default 0)"
        self.add_argument(
            "--trainer-core", "--client-core", type=int, default=0, metavar="CORE", help=help
        )
        help = f"the core a local server is pinned to (default the last: {last})"
        self.add_argument("--server-core", type=int, default=last, metavar="CORE", help=help)

    def part_size(self) -> None:
        default, help = _DEFAULTS.part_size // MiB, "S3Config.part_size in MiB"
        self.scaled("--part-size-mib", default, None, help, type=positive_int, metavar="MIB")

    def concurrency(self) -> None:
        default, help = _DEFAULTS.max_concurrency, "S3Config.max_concurrency"
        self.scaled("--concurrency", default, None, help, type=positive_int, metavar="N")

    def child(self, **kwargs: Any) -> None:
        """Internal: ``--child`` runs one case in a fresh process, its numbers to ``--child-out``
        (``kwargs`` go to ``--child``)."""
        self.add_argument("--child", help=argparse.SUPPRESS, **kwargs)
        self.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)


def endpoint(args: argparse.Namespace) -> contextlib.AbstractContextManager[Endpoint]:
    """The server that `Parser.server`'s flags name (see `common.s3_endpoint`)."""
    return s3_endpoint(args.endpoint_url, args.access_key, args.secret_key, args.region)
