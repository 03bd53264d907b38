"""Threads ``threading`` did not start (PyTorch's autograd device threads, tf.data's) are named
as the OS names them, also once something asked ``threading`` about them and it made up a
``Dummy-N``; a thread nobody named is ``thread <tid>``; ``threading``'s own threads keep their
names."""

from __future__ import annotations

import _thread
import ctypes
import ctypes.util
import threading

import pytest

from gpu_trace.tracer.buffer import ThreadBuffer, thread_name

PR_SET_NAME = 15

libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def on_foreign_thread(comm: str | None, *, ask_threading: bool) -> dict[str, object]:
    """Run on a thread from ``_thread`` (a native thread, to ``threading``), named ``comm`` by
    ``prctl`` as PyTorch's ``c10::setThreadName`` does; ``ask_threading``: call
    ``threading.current_thread()`` on it first (``logging`` does, for every record), which
    registers it as ``Dummy-N``. Returns what the thread's buffer and ``thread_name`` say, read
    while the thread is still alive."""
    seen: dict[str, object] = {}
    ready, finish = threading.Event(), threading.Event()

    def body() -> None:
        try:
            if comm is not None:
                assert libc.prctl(PR_SET_NAME, comm.encode(), 0, 0, 0) == 0
            if ask_threading:
                seen["threading"] = threading.current_thread().name
            seen["ident"] = threading.get_ident()
            seen["tid"] = threading.get_native_id()
            seen["buffer"] = ThreadBuffer(8).thread_name
        finally:
            ready.set()
            finish.wait(60)

    _thread.start_new_thread(body, ())
    assert ready.wait(60)
    try:
        seen["by_tid"] = thread_name(int(seen["tid"]))  # type: ignore[call-overload]
    finally:
        finish.set()
        # threading never forgets a Dummy-N (3.11): unregister it, as it was before the test.
        with threading._active_limbo_lock:  # type: ignore[attr-defined]
            threading._active.pop(seen.get("ident"), None)  # type: ignore[attr-defined]
    return seen


@pytest.mark.parametrize("ask_threading", [False, True])
def test_an_autograd_thread_is_named_as_pytorch_names_it(ask_threading: bool) -> None:
    seen = on_foreign_thread("pt_autograd_0", ask_threading=ask_threading)
    if ask_threading:
        assert str(seen["threading"]).startswith("Dummy-")
    assert seen["buffer"] == seen["by_tid"] == "pt_autograd_0"


def test_a_thread_nobody_named_is_thread_tid() -> None:
    seen = on_foreign_thread(None, ask_threading=True)
    assert seen["buffer"] == seen["by_tid"] == f"thread {seen['tid']}"


def test_threadings_own_threads_keep_their_names() -> None:
    seen: dict[str, str] = {}

    def body() -> None:
        seen["buffer"] = ThreadBuffer(8).thread_name
        seen["by_tid"] = thread_name(threading.get_native_id())

    t = threading.Thread(target=body, name="loader")
    t.start()
    t.join(60)
    assert seen == {"buffer": "loader", "by_tid": "loader"}
    assert ThreadBuffer(8).thread_name == "MainThread"
