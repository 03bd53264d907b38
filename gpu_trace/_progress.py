"""A terminal progress bar for long CLI operations (``progress=`` of the Chrome exporter)."""

from __future__ import annotations

from typing import TextIO


class TerminalProgress:
    """A one-line progress bar for ``progress=``; draws only when ``stream`` is a terminal."""

    def __init__(self, stream: TextIO, *, width: int = 30, label: str = "spans") -> None:
        self.stream = stream
        self.width = width
        self.label = label
        self._last: str | None = None
        try:
            self.enabled = bool(stream.isatty())
        except (AttributeError, ValueError):
            self.enabled = False

    def __call__(self, done: int, total: int | None) -> None:
        if not self.enabled:
            return
        if total:
            frac = min(done / total, 1.0)
            filled = int(frac * self.width)
            line = f"[{'#' * filled}{'.' * (self.width - filled)}] {frac:4.0%} {done:,}/{total:,} {self.label}"
        else:
            line = f"{done:,} {self.label}"
        if line != self._last:
            self._last = line
            self.stream.write("\r" + line)
            if total and done >= total:  # finished: end the line so later output starts clean
                self.stream.write("\n")
                self._last = None
            self.stream.flush()

    def close(self) -> None:
        """End the line (only if something was drawn)."""
        if self.enabled and self._last is not None:
            self.stream.write("\n")
            self.stream.flush()
            self._last = None
