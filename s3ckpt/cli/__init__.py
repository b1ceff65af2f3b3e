"""The ``s3ckpt`` command line (`main`: the parser, the exit codes and the subcommands' home)."""

from .main import main

__all__ = ["main"]
