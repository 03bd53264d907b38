"""What each session and tenant has used on a shared server: the numbers behind ``/metrics``,
``gpu-trace tenants`` and the per-tenant counters in the run.

The executor updates a session's :class:`Usage` as it runs its work (one thread, no locks),
except ``gpu_busy_ns``, which the server's GPU activity thread adds to as kernels arrive (under
the ledger's lock, :meth:`~gpu_trace.runtime.server.admin.Ledger.add_gpu_busy`); readers (the
metrics endpoint, the admin listing) take :meth:`Usage.snapshot` copies.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Usage:
    """One session's usage since it connected.

    ``busy_ns``: device time of its batches (CUDA events on a GPU, wall time on the CPU device);
    ``queue_ns``: time its batches waited for the executor; ``bytes_in``/``bytes_out``: tensor
    bytes uploaded and downloaded; ``evictions``/``restores``: times its tensors were paged out
    to host memory and back; ``evicted_bytes``: bytes currently paged out; ``quota_waits`` and
    ``quota_errors``: ops that waited for memory, or failed on the quota; ``gpu_busy_ns``: time
    its kernels kept the GPU busy (the union of their intervals, from the server's GPU activity
    capture; None where there is none: the CPU device, or capture off or unavailable).
    """

    busy_ns: int = 0
    queue_ns: int = 0
    batches: int = 0
    ops: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    evictions: int = 0
    restores: int = 0
    evicted_bytes: int = 0
    quota_waits: int = 0
    quota_errors: int = 0
    last_active_ns: int = 0
    gpu_busy_ns: int | None = None

    def snapshot(self) -> dict[str, int | None]:
        return asdict(self)
