"""``python -m aioloader`` (also the ``aioloader`` command): see ``aioloader --help``."""

from __future__ import annotations

import sys

from ._cli.command import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
