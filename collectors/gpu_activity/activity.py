"""The raw GPU activity record: one fixed layout for every kind, shared by C and Python.

CUPTI hands out records of many struct types and versions (``CUpti_ActivityKernel10``,
``CUpti_ActivityMemcpy6``, ``CUpti_ActivityAPI``...). The injection library (``injection.c``)
copies the fields gpu-trace uses into one packed little-endian struct, ``struct gt_record``, and
writes arrays of them; the replay reader (:mod:`.replay_file`) fills the same layout from recorded
JSON. So everything after capture reads one numpy structured array, :data:`RECORD`, whatever made
it, and the conversion to spans (:mod:`.conversion`) is one vectorized path.

Kinds keep CUPTI's numbers (``CUpti_ActivityKind``): the file is self-describing to anyone who
knows CUPTI. ``code`` is the ``cbid`` of an API call, or the id of a kernel's name in the file's
name table; ``sub`` is the memcpy kind, the memset's memory kind, or the synchronization type.
"""

from __future__ import annotations

import numpy as np

# CUpti_ActivityKind (cupti_activity.h).
MEMCPY = 1
MEMSET = 2
DRIVER = 4
RUNTIME = 5
CONCURRENT_KERNEL = 10
SYNCHRONIZATION = 38
KINDS = (MEMCPY, MEMSET, DRIVER, RUNTIME, CONCURRENT_KERNEL, SYNCHRONIZATION)
API_KINDS = (DRIVER, RUNTIME)
DEVICE_KINDS = (CONCURRENT_KERNEL, MEMCPY, MEMSET)

#: ``struct gt_record`` in injection.c, field for field (104 bytes, little-endian, packed).
RECORD = np.dtype(
    [
        ("kind", "<u1"),
        ("sub", "<u1"),  # memcpy kind | memset memory kind | synchronization type
        ("src_kind", "<u1"),  # memcpy source memory kind
        ("dst_kind", "<u1"),  # memcpy destination memory kind
        ("device", "<u4"),
        ("start", "<i8"),  # CUPTI's clock (or CLOCK_MONOTONIC: see activity_file.py)
        ("end", "<i8"),
        ("correlation", "<u4"),
        ("context", "<u4"),
        ("stream", "<u4"),
        ("pid", "<u4"),
        ("tid", "<u8"),  # the thread id CUPTI reports (system tid when the library set it so)
        ("code", "<u4"),  # cbid of an API call; name id of a kernel
        ("ret", "<i4"),  # an API call's return value
        ("bytes", "<u8"),
        ("grid", "<i4", (3,)),
        ("block", "<i4", (3,)),
        ("registers", "<u2"),
        ("pad", "<u2"),
        ("static_smem", "<u4"),
        ("dynamic_smem", "<u4"),
        ("reserved", "<u4"),
    ]
)
assert RECORD.itemsize == 104

#: A stream or device number CUPTI leaves unset (e.g. a context-wide synchronization).
NONE_U32 = 0xFFFFFFFF

# CUpti_ActivityMemcpyKind: the short names PyTorch's profiler prints ("Memcpy HtoD").
MEMCPY_KINDS = {
    0: "Unknown",
    1: "HtoD",
    2: "DtoH",
    3: "HtoA",
    4: "AtoH",
    5: "AtoA",
    6: "AtoD",
    7: "DtoA",
    8: "DtoD",
    9: "HtoH",
    10: "PtoP",
}
# CUpti_ActivityMemoryKind, named as PyTorch's profiler names them ("Pageable -> Device").
MEMORY_KINDS = {
    0: "Unknown",
    1: "Pageable",
    2: "Pinned",
    3: "Device",
    4: "Array",
    5: "Managed",
    6: "Device Static",
    7: "Managed Static",
}
# CUpti_ActivitySynchronizationType.
SYNC_TYPES = {
    0: "Unknown",
    1: "Event Synchronize",
    2: "Stream Wait Event",
    3: "Stream Synchronize",
    4: "Context Synchronize",
}


def empty(n: int = 0) -> np.ndarray:
    """``n`` zeroed records."""
    return np.zeros(n, dtype=RECORD)
