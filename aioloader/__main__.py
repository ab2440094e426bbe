"""``python -m aioloader demo`` (also the ``aioloader`` command)."""

from __future__ import annotations

import sys

USAGE = (
    "usage: aioloader demo [--samples N] [--epochs N] [--batch-size N] [--workers N] "
    "[--device DEVICE] [--url URL]"
)


def main(argv: list[str] | None = None) -> int:
    """Dispatch the command line; returns the exit status."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    if args[0] == "demo":
        from ._cli.demo import main as demo

        return demo(args[1:])
    print(f"aioloader: unknown command {args[0]!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
