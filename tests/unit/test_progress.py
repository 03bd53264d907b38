"""The CLI's progress lines (gpu_trace/_progress.py): drawn on a terminal only, and cleared
before the closing line."""

from __future__ import annotations

import io

from gpu_trace._progress import PhaseProgress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_phase_progress_draws_only_on_a_terminal() -> None:
    plain = io.StringIO()
    progress = PhaseProgress(plain, prefix="import")
    progress("reading MiB", 1, 2)
    progress.close()
    assert plain.getvalue() == ""


def test_phase_progress_redraws_one_line_and_clears_it() -> None:
    tty = _Tty()
    progress = PhaseProgress(tty, prefix="import", width=4)
    progress("reading MiB", 1, 2)
    progress("reading MiB", 1, 2)  # unchanged: not redrawn
    progress("parsing 2 MiB of JSON", 0, None)
    progress("storing 5 spans", 0, None)
    progress.close()
    first = "import: reading MiB [##..]  50% 1/2"
    second = "import: parsing 2 MiB of JSON"
    third = "import: storing 5 spans"
    assert tty.getvalue() == (
        f"\r{first}\r{second}{' ' * (len(first) - len(second))}"
        f"\r{third}{' ' * (len(second) - len(third))}\r{' ' * len(third)}\r"
    )
