"""A one-line progress bar for terminals, and plain lines elsewhere.

Owns: rendering progress for a person (the demo's bar, and ``DataLoader(progress=True)``'s).
Never: touches the loader; callers pass the counts.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """Redraws one line in place on a terminal; prints only the final line elsewhere (CI logs).

    Args:
        total: Units expected (samples).
        label: Shown before the bar.
        stream: Where to write (default: stdout).
        width: Characters of the bar itself.
        initial: Units done before (a resumed epoch): counted, but not in the rate.
    """

    def __init__(
        self,
        total: int,
        label: str,
        *,
        stream: TextIO | None = None,
        width: int = 30,
        initial: int = 0,
    ) -> None:
        self.total = max(1, total) if total else 0  # 0: not known (a stream)
        self.label = label
        self.stream = stream if stream is not None else sys.stdout
        self.width = width
        self.done = initial
        self.initial = initial
        self.started = time.perf_counter()
        self._last_draw = 0.0
        self.interactive = self.stream.isatty()

    def update(self, n: int, extra: str = "") -> None:
        """Count ``n`` more units; redraw at most 20 times a second."""
        self.done += n
        now = time.perf_counter()
        if self.interactive and (now - self._last_draw > 0.05 or self.done == self.total):
            self._last_draw = now
            self.stream.write("\r" + self.render(extra))
            self.stream.flush()

    def render(self, extra: str = "") -> str:
        rate = (self.done - self.initial) / max(1e-9, time.perf_counter() - self.started)
        if self.total:
            filled = min(self.width, self.width * self.done // self.total)
            bar = "#" * filled + "-" * (self.width - filled)
            line = f"{self.label} [{bar}] {self.done:,}/{self.total:,} {rate:,.0f}/s"
        else:
            line = f"{self.label} {self.done:,} {rate:,.0f}/s"
        return f"{line} {extra}" if extra else line

    def close(self, extra: str = "") -> None:
        """Finish the line (a terminal keeps it; elsewhere it is printed once)."""
        if self.interactive:
            self.stream.write("\r" + self.render(extra) + "\n")
        else:
            self.stream.write(self.render(extra) + "\n")
        self.stream.flush()
