"""A hook's failure, logged once: the traced program goes on and its log is not flooded.

Hooks (``gpu_trace.range``, the ``nvtx`` patches, the framework patches) never raise into the
program: each catches at its boundary and hands the exception to its module's :class:`WarnOnce`.
The first failure is logged with its traceback; later ones are not, since a hook that fails once
usually fails on every call.
"""

from __future__ import annotations

import logging


class WarnOnce:
    """``warn_once(what)`` in an ``except`` block logs ``message % what`` and the exception, the
    first time only. ``message`` has one ``%s``, for what failed."""

    __slots__ = ("log", "message", "warned")

    def __init__(self, log: logging.Logger, message: str) -> None:
        self.log = log
        self.message = message
        self.warned = False

    def __call__(self, what: str, exc: BaseException | None = None) -> None:
        """Log that ``what`` failed with ``exc`` (default: the exception being handled)."""
        if self.warned:
            return
        self.warned = True
        # stacklevel: the record names the hook that failed, not this method
        self.log.error(self.message, what, exc_info=exc if exc is not None else True, stacklevel=2)
