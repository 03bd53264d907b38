"""A page-out's pieces: which of a session's storages it would free, its copies to host memory on
a GPU, and its figures.

:class:`~gpu_trace.runtime.sharing.pager.Pager` pages a session out in three steps: it finds the
device storages whose copies would free memory (:func:`storage_groups`: a storage that a kept
graph holds stays), copies each into a host buffer (on a GPU, :func:`copy_out_cuda`, on the
pager's own stream after the session's and the default one: no device-wide synchronize), then
re-points the session's tensors at the host copies. The steps that read torch's storages, and the
figures a page-out leaves (:class:`PageOutStats`), are here; which session goes out, when, and
its accounts are the pager's.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from gpu_trace.runtime.sharing.restore import PagedStorage

if TYPE_CHECKING:
    import torch

    from gpu_trace.runtime.sharing.sessions import Session


@dataclass
class PageOutStats:
    """One page-out: ``bytes`` copied to the host, ``alloc_ns`` getting the host buffers,
    ``copy_ns`` the copies (CUDA event times on a GPU, from when the session's own work was
    done), ``all_ns`` the whole call."""

    session: int
    bytes: int
    storages: int
    pinned: bool
    device: str
    start_ns: int
    alloc_ns: int = 0
    copy_ns: int = 0
    all_ns: int = 0

    @property
    def bytes_per_s(self) -> float:
        """The copies' bandwidth (bytes copied over ``copy_ns``)."""
        return self.bytes * 1e9 / self.copy_ns if self.copy_ns else 0.0


def storage_groups(
    torch: ModuleType, device: torch.device, session: Session
) -> list[tuple[PagedStorage, Any]]:
    """The session's storages on ``device`` that paging out would free, with their tensors."""
    kind = device.type  # "cuda" and "cuda:0" are one device here
    keep = graph_keys(torch, session.graphs)
    groups: dict[int, tuple[PagedStorage, Any]] = {}
    seen: set[int] = set()
    for handle, t in session.handles.items():
        if (
            not isinstance(t, torch.Tensor)
            or t.layout != torch.strided
            or t.device.type != kind
            or t.is_quantized
        ):
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if not key or key in keep or storage.nbytes() == 0:
            continue
        if session.handles.key(handle) != key:  # storage swapped under the account
            keep.add(key)
            groups.pop(key, None)
            continue
        entry = groups.get(key)
        if entry is None:
            entry = groups[key] = (PagedStorage(storage.nbytes(), [], []), storage)
        st = entry[0]
        st.handles.append(handle)
        for x in (t, t._base):
            if x is not None and id(x) not in seen:
                seen.add(id(x))
                st.tensors.append(x)
    return list(groups.values())


def copy_out_cuda(
    torch: ModuleType,
    device: torch.device,
    side: torch.cuda.Stream,
    own: torch.cuda.Stream | None,
    groups: list[tuple[PagedStorage, torch.UntypedStorage]],
    stats: PageOutStats,
) -> None:
    """Copy ``groups`` into their host buffers on the pager's stream ``side``, and wait for them.

    The side stream first waits for the session's stream ``own`` (its last batch may still be
    writing these tensors) and for the device's default stream (work outside batches; the
    pager's stream, like every stream from PyTorch's pool, does not synchronize with it by
    itself): events on those two, where a device-wide synchronize, or this thread's current
    stream (another session's, when a batch of it asks for room), would also wait for other
    tenants' kernels in flight. The host then waits for the copies' own event only, so the
    device storages can be freed (the allocator may hand them to the session's stream at
    once).
    """
    side.wait_stream(torch.cuda.default_stream(device))
    if own is not None:
        side.wait_stream(own)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record(side)
    with torch.cuda.stream(side):
        for st, storage in groups:
            st.host.copy_(bytes_of(torch, storage), non_blocking=True)
    end.record(side)
    end.synchronize()
    stats.copy_ns = max(1, int(start.elapsed_time(end) * 1e6))


def bytes_of(torch: Any, storage: Any) -> Any:
    """A storage's bytes as a flat uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def use_count(torch: Any, storage: Any) -> int:
    """References to ``storage`` from tensors (and this one Python object)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return int(count(storage._cdata)) if count is not None else 1


def graph_keys(torch: Any, graphs: dict[int, Any]) -> set[int]:
    """Storages of the tensors kept graphs hold (``rt::fn`` leaves and outputs)."""
    keys: set[int] = set()
    stack = list(graphs.values())
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            keys.add(x.untyped_storage().data_ptr())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return keys
