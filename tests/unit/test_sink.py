"""The server's sinks all answer the one :class:`Sink` protocol the server and executor call."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from gpu_trace.runtime.server.sink import ReturnSink, Sink, SpoolSink, StoreSink

_METHODS = ("accepts", "export", "clock", "session_closed", "shutdown")


def test_the_protocol_names_what_the_server_calls() -> None:
    for name in _METHODS:
        assert callable(getattr(Sink, name))
    assert set(Sink.__annotations__) == {"kind", "server_device"}


@pytest.mark.parametrize("cls", [ReturnSink, SpoolSink, StoreSink])
def test_every_sink_has_the_protocol_methods_with_its_signatures(cls: type) -> None:
    for name in _METHODS:
        assert inspect.signature(getattr(cls, name)) == inspect.signature(getattr(Sink, name))


def test_a_spool_sink_is_a_sink(tmp_path: Path) -> None:
    sink: Sink = SpoolSink(tmp_path)
    assert sink.kind == "spool" and sink.server_device == ""
    assert not sink.accepts({"trace": "1"})  # no run id: not traced
