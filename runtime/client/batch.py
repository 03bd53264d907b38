"""What the forwarding client keeps about issued ops and sent batches until they are done."""

from __future__ import annotations

from typing import Any


class OpRecord:
    """What the client keeps about one issued op until its batch is done."""

    __slots__ = ("name", "stack", "t0", "t1", "result", "fetch")

    def __init__(self, name: str, stack: tuple | list, t0: int) -> None:
        self.name = name
        self.stack = stack
        self.t0 = t0
        self.t1 = t0
        self.result: Any = None
        self.fetch: int = 0


class Batch:
    """A sent batch: its ops' records and its client-side times (for the spans)."""

    __slots__ = (
        "seq",
        "span_id",
        "records",
        "t_first",
        "t_serialize",
        "t_send",
        "t_sent",
        "nbytes",
    )

    def __init__(self, seq: int, span_id: int, records: list[OpRecord], t_first: int) -> None:
        self.seq = seq
        self.span_id = span_id
        self.records = records
        self.t_first = t_first
        self.t_serialize = self.t_send = self.t_sent = 0
        self.nbytes = 0
