"""A batch's progress while it waits for memory is a typed :class:`Parked`, kept on its work."""

from __future__ import annotations

from types import SimpleNamespace

from gpu_trace.runtime.server.batch_parts import free_early as _free_early
from gpu_trace.runtime.sharing.scheduler import Parked, Work
from gpu_trace.runtime.sharing.sessions import MemoryAccount


def _session(sizes: dict[int, int]) -> SimpleNamespace:
    account = MemoryAccount()
    account.bytes = sum(sizes.values())
    freed: list[int] = []

    def free(handle: int) -> None:
        freed.append(handle)
        account.bytes -= sizes.pop(handle, 0)

    return SimpleNamespace(account=account, free=free, freed=freed)


def test_a_fresh_work_has_no_progress() -> None:
    assert Work("batch").resume is None
    p = Parked()
    assert p.index == -1 and p.results == {} and p.op_spans == [] and p.wait is None
    assert not hasattr(p, "__dict__")  # slots: a typo'd field fails instead of being kept


def test_the_batch_frees_early_once_and_the_progress_says_so() -> None:
    session = _session({1: 100, 2: 200, 3: 300})
    work = Work("batch")
    ops = [["aten::neg.default", [{"h": 2}], {}, [4]]]  # names handle 2: not freed early
    assert _free_early(session, work, ops, 0, [1, 2, 3])
    assert session.freed == [1, 3]
    assert isinstance(work.resume, Parked) and work.resume.freed_early
    assert not _free_early(session, work, ops, 0, [1, 2, 3])  # once per batch
    assert session.freed == [1, 3]
