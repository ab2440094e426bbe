"""The command line: ``aioloader`` (and ``python -m aioloader``).

Owns: the parser (the commands, ``--version``, one-line argument errors) and :func:`main`, which
runs a command and turns how it ended into what a person reads and an exit status.

Every command prints one line for a failure a person can fix (with exit status 2; ``--verbose``
adds the traceback), ``interrupted`` for Ctrl-C (130) and ``terminated`` for SIGTERM (143),
after the command has cleaned up (worker processes stopped, temporary files removed).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys
import traceback
from typing import NoReturn

__all__ = ["main", "parser"]


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad argument said in one line (and where to look), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _version() -> str:
    try:
        mine = importlib.metadata.version("aioloader")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        mine = "(not installed)"

    try:
        import torch

        with_torch = f"torch {torch.__version__}"
    except ImportError:  # pragma: no cover - torch is a dependency
        with_torch = "torch not installed"
    return f"aioloader {mine} ({with_torch}, Python {platform.python_version()})"


def parser() -> argparse.ArgumentParser:
    """The command line's parser: ``demo`` and ``bench`` (and the options every command
    takes)."""
    from . import bench, demo

    top = _Parser(
        prog="aioloader",
        description="An asyncio-native data loader for PyTorch. Commands:",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    top.add_argument("--version", action="version", version=_version())
    commands = top.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    demo.add_command(commands)
    bench.add_command(commands)
    return top


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    from .errors import EXIT_INTERRUPTED, EXIT_TERMINATED, EXIT_USAGE, explain
    from .signals import Terminated

    top = parser()
    args = top.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        top.print_help(sys.stderr)
        return EXIT_USAGE
    prog = f"aioloader {args.command}"
    try:
        status: int = args.run(args)
    except BrokenPipeError:  # the reader went away (`| head`): say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a command cut off this way
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated:
        print(f"{prog}: terminated", file=sys.stderr)
        return EXIT_TERMINATED
    except Exception as exc:
        line = explain(exc)
        if line is None:
            raise  # not one we know: its traceback is worth a report
        if args.verbose:
            traceback.print_exception(exc)
        print(f"{prog}: {line}", file=sys.stderr)
        return EXIT_USAGE
    return status
