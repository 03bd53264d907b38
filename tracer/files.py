"""Writing run files when the disk may be full: knowing the error, and small files kept current.

A spool write that fails is the recorder's to retry (``recorder.py``); the small files a run keeps
rewriting (``stats/<pid>.json``, ``run.json``) are replaced whole here: a temporary is written and
renamed over the file, so a reader never sees half of one. On a full disk there is no room for the
temporary; the file is then overwritten in place, which takes no new block when the new text fits
in the blocks the file already holds (these files are far smaller than one block). Either way a
failure leaves no temporary behind.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` says the disk (or the user's quota on it) is full."""
    if not isinstance(exc, OSError):
        return False
    # Arrow's I/O errors are OSErrors that carry the errno in their text only.
    return exc.errno in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in str(exc)


def replace_text(path: Path, text: str) -> None:
    """Replace ``path``'s contents with ``text``; raises OSError when neither way works."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    data = text.encode()
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if not disk_full(exc):
            raise
        try:
            allocated = path.stat().st_blocks * 512
        except OSError:
            raise exc from None
        if len(data) > allocated:
            raise
    with open(path, "r+b") as f:  # within blocks the file owns: no allocation, no ENOSPC
        f.write(data)
        f.truncate(len(data))
