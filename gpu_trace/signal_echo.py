"""How `gpu-trace record` knows whether a signal it got reached the program too.

`record` and the program share a process group, so a signal sent to the group (``kill -INT
-PGID``, GNU ``timeout``, a scheduler ending a job) reaches both: forwarding it as well gave the
program two, and the second broke into what the program did about the first (saving a
checkpoint, its traceback, the recorder's last flush). A terminal's ^C is told apart by its
``si_code`` (the kernel sent it: :data:`gpu_trace.launch.SI_KERNEL`); a ``kill`` is not: to
the kernel a signal sent to one process and one sent to its group look the same.

So the program tells: `record` gives its Python program the write end of a pipe, and the
program's start-up (``gpu_trace/_boot/sitecustomize.py``) makes it Python's signal wakeup fd
(:func:`signal.set_wakeup_fd`), to which Python's C signal handler writes the number of every
signal the process gets, the moment it gets it. When a ``kill``'d SIGINT or SIGTERM reaches
`record`, it reads the pipe (waiting up to :data:`GRACE_S` for the program to be scheduled):
the signal's number there means the program got it itself, and it is not forwarded; nothing
there means it was sent to `record` alone, and it is.

Where the program cannot tell (not Python; a program that sets its own wakeup fd, as asyncio's
``add_signal_handler`` does; ignored or default dispositions, which install no C handler; a
program not scheduled within the grace on a loaded machine), `record` forwards, as it did
before: at worst the program gets a signal twice.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import stat
import time

#: The variable `record` passes the pipe in: ``FD:RECORD_PID:INODE``.
ENV = "GPU_TRACE_SIGNAL_ECHO"
#: Seconds `record` waits for the program's echo of a signal before forwarding it.
GRACE_S = 0.5


class Echo:
    """`record`'s end: the pipe whose write end the program gets (``pass_fds``, :attr:`env`)."""

    def __init__(self) -> None:
        self._read, self.write_fd = os.pipe()
        os.set_blocking(self._read, False)
        ino = os.fstat(self.write_fd).st_ino
        #: What the program's environment gets (:data:`ENV`).
        self.env = {ENV: f"{self.write_fd}:{os.getpid()}:{ino}"}
        self._seen: dict[int, float] = {}  # signal -> when the program last said it got one

    def started(self) -> None:
        """The program has its copy of the write end: close ours (so a dead program's pipe
        reads as closed, and no byte of ours is mistaken for its)."""
        with contextlib.suppress(OSError):
            os.close(self.write_fd)

    def read(self) -> None:
        """Take what the program said so far (each signal's latest time)."""
        self._take()

    def program_got(self, signum: int, grace_s: float = GRACE_S) -> bool:
        """Whether the program got ``signum`` itself: said within ``grace_s`` before now, or
        within ``grace_s`` after. One echo answers one signal."""
        now = time.monotonic()
        deadline = now + grace_s
        while True:
            self._take()
            if self._seen.get(signum, -1.0) >= now - grace_s:
                del self._seen[signum]
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            poller = select.poll()  # not select(): a descriptor past 1024 is out of its range
            poller.register(self._read, select.POLLIN)
            try:
                ready = poller.poll(left * 1000)
            except InterruptedError:
                continue
            if not ready:
                return False

    def close(self) -> None:
        for fd in (self._read, self.write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _take(self) -> None:
        while True:
            try:
                data = os.read(self._read, 4096)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if not data:  # every write end closed: the program is gone
                return
            now = time.monotonic()
            for signum in data:
                self._seen[signum] = now


def echo_from_env() -> bool:
    """The program's end, at its start-up: make the pipe `record` passed (:data:`ENV`) Python's
    signal wakeup fd; False (nothing done) unless this process is the one `record` started,
    the descriptor is that pipe, and this is the main thread with no wakeup fd set yet."""
    spec = os.environ.get(ENV)
    if not spec:
        return False
    try:
        fd, parent, ino = (int(part) for part in spec.split(":"))
        if os.getppid() != parent:  # a child of the program: the number may be another file
            return False
        st = os.fstat(fd)
        if not stat.S_ISFIFO(st.st_mode) or st.st_ino != ino:
            return False
        os.set_inheritable(fd, False)
        os.set_blocking(fd, False)
        old = signal.set_wakeup_fd(fd, warn_on_full_buffer=False)
        if old != -1:  # someone set one already: theirs stays
            signal.set_wakeup_fd(old)
            return False
    except (ValueError, OSError):
        return False
    return True
