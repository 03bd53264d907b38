"""The `gpu-trace` commands, one module per concern; :mod:`gpu_trace.cli` parses and dispatches.

Only the command line prints or exits: these modules and :mod:`gpu_trace.cli`. Errors are one line
on stderr, ``gpu-trace: ...``, raised as :class:`CLIError` with the exit status.
"""

from __future__ import annotations

import sys

from gpu_trace import _format


class CLIError(Exception):
    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def check_settings() -> None:
    """Every ``GPU_TRACE_*`` setting that is set, checked before a command starts its work (a
    program, a server): a bad one is one line and exit 2 instead of a feature quietly off."""
    from gpu_trace import config

    try:
        config.check_environment()
    except ValueError as exc:
        raise CLIError(str(exc), 2) from None


def echo(text: str) -> None:
    """Print to stdout; control characters from stored names are shown escaped (lines kept)."""
    print(_format.text(text, keep="\n"))


def err(text: str) -> None:
    """One line on stderr, ``gpu-trace: ...``, with control characters shown escaped."""
    print(f"gpu-trace: {_format.text(text)}", file=sys.stderr)
