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


class PhaseProgress:
    """A one-line progress report for work in phases (``import``: reading, decompressing,
    parsing, converting, storing): ``progress(phase, done, total)`` redraws the line with the
    phase and, where ``total`` is known, a bar; :meth:`close` clears it so the closing line
    starts clean. Draws only when ``stream`` is a terminal, at most one line per change of
    phase or whole percent."""

    def __init__(self, stream: TextIO, *, prefix: str, width: int = 30) -> None:
        self.stream = stream
        self.prefix = prefix
        self.width = width
        self._last: str | None = None
        self._drawn = 0
        try:
            self.enabled = bool(stream.isatty())
        except (AttributeError, ValueError):
            self.enabled = False

    def __call__(self, phase: str, done: int, total: int | None) -> None:
        if not self.enabled:
            return
        if total:
            frac = min(done / total, 1.0)
            filled = int(frac * self.width)
            bar = f"[{'#' * filled}{'.' * (self.width - filled)}] {frac:4.0%}"
            line = f"{self.prefix}: {phase} {bar} {done:,}/{total:,}"
        else:
            line = f"{self.prefix}: {phase}" + (f" {done:,}" if done else "")
        if line == self._last:
            return
        self._last = line
        pad = " " * max(0, self._drawn - len(line))
        self.stream.write("\r" + line + pad)
        self._drawn = len(line)
        self.stream.flush()

    def close(self) -> None:
        """Clear the line (only if something was drawn)."""
        if self.enabled and self._drawn:
            self.stream.write("\r" + " " * self._drawn + "\r")
            self.stream.flush()
            self._drawn, self._last = 0, None
