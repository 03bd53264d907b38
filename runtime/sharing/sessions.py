"""A client's session on the server: its handle table, blobs, memory account and span log.

Everything a session can reach is in its own tables: a handle is an integer the client chose,
looked up only in this session's :class:`HandleTable`, so another session's tensors are never
reachable. :class:`MemoryAccount` counts the bytes of the distinct storages a session holds (views
share their base's storage); the server's :class:`~gpu_trace.runtime.sharing.memory.Memory` sums the
accounts per tenant for quotas (``on_change``), and the pager marks which bytes are paged out.

It lives in sharing, below the server, because it is what sharing works on: the scheduler queues
sessions' work, memory sums their accounts, the pager moves their handles' storages. The server
makes sessions and runs their ops; sharing needs nothing of the server to hold them.
"""

from __future__ import annotations

import itertools
import random
import threading
from collections.abc import Callable, Iterable
from typing import Any

from gpu_trace.runtime.protocol.errors import OpError
from gpu_trace.runtime.protocol.templates import Templates
from gpu_trace.runtime.protocol.wire import MAX_TENSOR_BYTES, ProtocolError
from gpu_trace.runtime.sharing.tenants import Tenant
from gpu_trace.runtime.sharing.usage import Usage

#: Most live handles one session may hold.
MAX_HANDLES = 1 << 22
#: Most autograd graphs a session may keep on the server (``rt::fn``).
MAX_GRAPHS = 1 << 16
#: Most bytes of uploads a session may have received but not yet used.
MAX_PENDING_BLOB_BYTES = 8 << 30


class MemoryAccount:
    """Bytes of distinct storages held by one session's handles (and its pending uploads)."""

    def __init__(self, limit_bytes: int | None = None) -> None:
        self.limit_bytes = limit_bytes
        self.bytes = 0
        self.peak_bytes = 0
        self._storages: dict[int, list[int]] = {}  # storage key -> [nbytes, references]
        #: Called with the account after every change (quota enforcement, counters).
        self.on_change: Callable[[MemoryAccount], None] | None = None
        #: Storages are counted as the device's allocator holds them: rounded up to a multiple
        #: of this (512 on CUDA, set by :class:`~gpu_trace.runtime.sharing.memory.Memory`).
        self.block_bytes = 1
        #: Of ``bytes``, those of storages the pager has paged out to host memory (kept equal to
        #: the session's ``usage.evicted_bytes``); ``bytes`` stays the logical total.
        self.paged_bytes = 0
        self._paged: dict[int, int] = {}  # storage key -> nbytes, for storages paged out

    def charge(self, tensor: Any) -> int:
        storage = tensor.untyped_storage()
        key = storage.data_ptr() or id(storage)
        entry = self._storages.get(key)
        if entry is None:
            n = storage.nbytes()
            if self.block_bytes > 1 and n:
                n = -(-n // self.block_bytes) * self.block_bytes
            entry = self._storages[key] = [n, 0]
            self._add(entry[0])
        entry[1] += 1
        return key

    def release(self, key: int) -> None:
        self.release_many((key,))

    def release_many(self, keys: Iterable[int]) -> None:
        """:meth:`release` of each key, with one ``on_change`` at the end (a batch's frees)."""
        storages = self._storages
        freed = 0
        for key in keys:
            entry = storages.get(key)
            if entry is None:
                continue
            entry[1] -= 1
            if entry[1] <= 0:
                del storages[key]
                if self._paged:
                    self.paged_bytes -= self._paged.pop(key, 0)
                freed += entry[0]
        if freed:
            self._add(-freed)

    def move(self, old_key: int, new_key: int, paged: bool) -> int:
        """The pager moved a storage to host memory (``paged``) or back: same bytes, new key.

        Returns the storage's counted bytes (0 if no handle holds it any more).
        """
        entry = self._storages.pop(old_key, None)
        if entry is None:
            return 0
        self._storages[new_key] = entry
        n = self._paged.pop(old_key, 0)
        if paged:
            self._paged[new_key] = entry[0]
        self.paged_bytes += (entry[0] if paged else 0) - n
        if self.on_change is not None:
            self.on_change(self)
        return entry[0]

    def regrow(self, key: int, storage: Any) -> int:
        """An op grew the storage counted under ``key`` in place (``resize_``, an ``out=``
        argument too small), which may have moved its data: count it at its size now, under its
        key now. Returns that key."""
        entry = self._storages.pop(key, None)
        new_key = storage.data_ptr() or id(storage)
        if entry is None:
            return new_key
        if self._paged:  # not paged out any more: ops run on restored storages only
            self.paged_bytes -= self._paged.pop(key, 0)
        n = storage.nbytes()
        if self.block_bytes > 1 and n:
            n = -(-n // self.block_bytes) * self.block_bytes
        other = self._storages.get(new_key)
        if other is not None:  # counted under its new key already: one entry
            other[1] += entry[1]
            self._add(-entry[0])
            return new_key
        grown, entry[0] = n - entry[0], n
        self._storages[new_key] = entry
        if grown:
            self._add(grown)
        return new_key

    @property
    def resident_bytes(self) -> int:
        """Bytes on the device: ``bytes`` less what is paged out to host memory."""
        return self.bytes - self.paged_bytes

    def charge_bytes(self, n: int) -> None:
        self._add(n)

    def _add(self, n: int) -> None:
        self.bytes += n
        if self.bytes > self.peak_bytes:
            self.peak_bytes = self.bytes
        if self.on_change is not None:
            self.on_change(self)

    def over_limit(self) -> bool:
        return self.limit_bytes is not None and self.bytes > self.limit_bytes


class HandleTable:
    """One session's tensors by the client's handle numbers."""

    def __init__(self, account: MemoryAccount) -> None:
        self.account = account
        self._tensors: dict[int, Any] = {}
        self._keys: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._tensors)

    def get(self, handle: int) -> Any:
        try:
            return self._tensors[handle]
        except KeyError:
            raise OpError(
                f"unknown tensor handle {handle} (freed, or never produced because an earlier "
                "op failed)"
            ) from None

    def put(self, handle: Any, tensor: Any) -> None:
        if type(handle) is not int or handle <= 0:
            raise ProtocolError("output handles must be positive integers")
        if handle in self._tensors:
            raise OpError(f"tensor handle {handle} is already in use")
        if len(self._tensors) >= MAX_HANDLES:
            raise OpError(f"a session may hold at most {MAX_HANDLES} tensors")
        self._tensors[handle] = tensor
        self._keys[handle] = self.account.charge(tensor)

    def items(self) -> list[tuple[int, Any]]:
        """``(handle, tensor)`` pairs, in the order the handles were made."""
        return list(self._tensors.items())

    def moved(self, old_key: int, new_key: int, handles: list[int], paged: bool) -> int:
        """The pager moved the storage ``handles`` share (see :meth:`MemoryAccount.move`)."""
        keys = self._keys
        for handle in handles:
            if keys.get(handle) == old_key:
                keys[handle] = new_key
        return self.account.move(old_key, new_key, paged)

    def regrown(self, handle: int) -> None:
        """An op grew ``handle``'s storage in place: count it anew (see
        :meth:`MemoryAccount.regrow`), for every handle that shares it."""
        key = self._keys.get(handle)
        if key is None:
            return
        new_key = self.account.regrow(key, self._tensors[handle].untyped_storage())
        if new_key != key:
            keys = self._keys
            for h in [h for h, k in keys.items() if k == key]:
                keys[h] = new_key

    def key(self, handle: int) -> int | None:
        """The account key of ``handle``'s storage (None: no such handle)."""
        return self._keys.get(handle)

    def free(self, handle: Any) -> None:
        self.free_many((handle,))

    def free_many(self, handles: Iterable[Any]) -> None:
        """:meth:`free` of each handle, the account changed once."""
        tensors, keys = self._tensors, self._keys
        gone = []
        for handle in handles:
            if type(handle) is int and tensors.pop(handle, None) is not None:
                gone.append(keys.pop(handle))
        if gone:
            self.account.release_many(gone)

    def clear(self) -> None:
        self.free_many(list(self._tensors))


class Blobs:
    """Uploads by id: inline ones arrive whole, large ones as PUT then CHUNKs."""

    def __init__(self, account: MemoryAccount) -> None:
        self.account = account
        self._done: dict[int, Any] = {}
        self._partial: dict[int, list[Any]] = {}  # id -> [dtype, shape, buffer, received]
        self.pending_bytes = 0

    def _reserve(self, ident: int, nbytes: int) -> None:
        if ident in self._done or ident in self._partial:
            raise ProtocolError(f"blob {ident} sent twice")
        if self.pending_bytes + nbytes > MAX_PENDING_BLOB_BYTES:
            raise ProtocolError("too many bytes uploaded and not yet used")
        self.pending_bytes += nbytes
        self.account.charge_bytes(nbytes)

    def add(self, ident: int, tensor: Any, nbytes: int) -> None:
        self._reserve(ident, nbytes)
        self._done[ident] = (tensor, nbytes)

    def begin(self, ident: int, dtype: Any, shape: list[int], nbytes: int) -> None:
        from gpu_trace.runtime.protocol.values import empty_buffer

        if nbytes > MAX_TENSOR_BYTES:
            raise ProtocolError("upload too large")
        self._reserve(ident, nbytes)
        self._partial[ident] = [dtype, shape, empty_buffer(nbytes), 0]

    def chunk(self, ident: int, offset: int, data: memoryview) -> None:
        entry = self._partial.get(ident)
        if entry is None:
            raise ProtocolError(f"chunk for unknown upload {ident}")
        dtype, shape, buf, received = entry
        if offset != received or offset + len(data) > buf.numel():
            raise ProtocolError("chunk out of order or past the end of its upload")
        if len(data):
            buf.numpy()[offset : offset + len(data)] = data
        entry[3] = received + len(data)
        if entry[3] == buf.numel():
            del self._partial[ident]
            self._done[ident] = (buf.view(dtype).reshape(shape), buf.numel())

    def take(self, ident: int) -> Any:
        try:
            tensor, nbytes = self._done.pop(ident)
        except KeyError:
            raise OpError(f"upload {ident} is missing or was already used") from None
        self.pending_bytes -= nbytes
        self.account.charge_bytes(-nbytes)
        return tensor

    def clear(self) -> None:
        for ident in list(self._done):
            self.take(ident)
        for entry in self._partial.values():
            self.account.charge_bytes(-entry[2].numel())
        self.pending_bytes = 0
        self._partial.clear()


class SpanLog:
    """Server spans and counters of one session, held until the next TRACE message."""

    def __init__(self) -> None:
        self.prefix = (random.getrandbits(31) | 1) << 32
        self._seq = itertools.count(1)
        self.spans: list[list[Any]] = []
        self.counters: list[list[Any]] = []
        self.last_sent_ns = 0
        #: Per kind of span that can overlap itself (``server/queue``), each of its lanes'
        #: latest end (``span_tables.slot_lane``).
        self.lane_ends: dict[str, list[int]] = {}
        # GPU activity spans (Arrow tables), added by the server's conversion thread
        # (device_activity.py).
        self._tables: list[object] = []
        self._tables_lock = threading.Lock()

    def new_id(self) -> int:
        return self.prefix + next(self._seq)

    def span(
        self,
        span_id: int,
        parent: int,
        lane: str,
        name: str,
        start: int,
        end: int,
        attrs: dict[str, str] | None = None,
    ) -> None:
        self.spans.append([span_id, parent, lane, name, start, end, attrs])

    def counter(self, metric: str, ts: int, value: float, labels: dict[str, str]) -> None:
        self.counters.append([metric, ts, value, labels])

    def add_table(self, table: object) -> None:
        """Spans made on another thread (GPU activity: a ``spans`` table, server times); they go
        out with the next :meth:`take`, under ``gpu``."""
        with self._tables_lock:
            self._tables.append(table)

    def take(self) -> dict[str, Any]:
        """What to send: ``spans`` and ``counters`` (rows), and ``gpu`` (tables) when there are."""
        spans, self.spans = self.spans, []
        counters, self.counters = self.counters, []
        if self._tables:
            with self._tables_lock:
                tables, self._tables = self._tables, []
            return {"spans": spans, "counters": counters, "gpu": tables}
        return {"spans": spans, "counters": counters}


class Session:
    """One authenticated client connection's state on the server."""

    _ids = itertools.count(1)

    def __init__(
        self, client: dict[str, Any], send: Callable[..., None], tenant: Tenant | None = None
    ) -> None:
        self.id = next(Session._ids)
        self.client = client
        #: The tenant the client authenticated as (quota, weight, priority).
        self.tenant = tenant if tenant is not None else Tenant(name="default", token="")
        #: What the session has used (:mod:`gpu_trace.runtime.sharing.usage`).
        self.usage = Usage()
        self.send = send
        self.account = MemoryAccount()
        self.handles = HandleTable(self.account)
        self.blobs = Blobs(self.account)
        self.trace = bool(client.get("trace"))
        #: The client takes the binary DONE_OK (:mod:`gpu_trace.runtime.protocol.wire`).
        self.binary = False
        self.log = SpanLog()
        self.graphs: dict[int, Any] = {}
        #: Op templates by id (:mod:`gpu_trace.runtime.protocol.templates`); the connection's thread
        #: adds them, in the order batches arrive.
        self.templates = Templates()
        self.rng_state: Any = None
        self.seed: int | None = random.getrandbits(63)
        self.closed = False
        self.lock = threading.Lock()
        self.batches = 0
        self.ops = 0

    def add_graph(self, ident: Any, graph: Any) -> None:
        """Keep a server-side autograd graph (``rt::fn``) until its backward or its free."""
        if type(ident) is not int or ident <= 0 or ident in self.graphs:
            raise OpError("graph ids are fresh positive integers")
        if len(self.graphs) >= MAX_GRAPHS:
            raise OpError(f"a session may keep at most {MAX_GRAPHS} graphs")
        self.graphs[ident] = graph

    def take_graph(self, ident: Any) -> Any:
        try:
            return self.graphs.pop(ident)
        except (KeyError, TypeError):
            raise OpError(f"unknown graph {str(ident)[:20]} (freed, or already used)") from None

    def free(self, ident: Any) -> None:
        """Free a tensor handle or a kept graph."""
        if self.graphs and ident in self.graphs:
            del self.graphs[ident]
        else:
            self.handles.free(ident)

    def free_many(self, idents: list[Any]) -> None:
        """:meth:`free` of each (a batch's ``free`` list)."""
        graphs = self.graphs
        if graphs:
            handles = []
            for ident in idents:
                if type(ident) is int and ident in graphs:
                    del graphs[ident]
                else:
                    handles.append(ident)
            idents = handles
        self.handles.free_many(idents)

    def close(self) -> None:
        """Free everything the session holds (the executor calls this between batches)."""
        with self.lock:
            self.closed = True
            self.graphs.clear()
            self.handles.clear()
            self.blobs.clear()
            self.rng_state = None
