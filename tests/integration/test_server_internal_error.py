"""A bug in the server's executor ends the session with an error the client raises, instead of
leaving the client waiting for a reply that never comes."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from gpu_trace import runtime
from gpu_trace.runtime.server.server import Server

TOKEN = "internal-error-token-0123"


@pytest.fixture
def server() -> Iterator[Server]:
    with Server("127.0.0.1:0", token=TOKEN) as srv:
        yield srv


def test_a_batch_that_raises_in_the_executor_ends_the_session_with_an_error(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    dev = runtime.connect(server.address, token=TOKEN, timeout_s=20)
    try:
        x = torch.ones(4, device=dev)
        runtime.synchronize()
        original = server.executor._batch

        def broken(session: Any, work: Any) -> None:
            raise NameError("a bug in the executor")

        server.executor._batch = broken  # type: ignore[method-assign]
        outcome: list[BaseException | None] = []

        def sync() -> None:
            try:
                float((x + 1).sum())
                outcome.append(None)
            except BaseException as exc:  # what the program would see
                outcome.append(exc)

        worker = threading.Thread(target=sync, daemon=True)
        worker.start()
        worker.join(15)  # the client's own timeout is 20 s: an answer must come before it
        server.executor._batch = original  # type: ignore[method-assign]
        assert not worker.is_alive(), "the client is still waiting for the server"
        (error,) = outcome
        assert isinstance(error, runtime.RemoteError)
        assert "internal error in the server (NameError: a bug in the executor)" in str(error)
    finally:
        runtime.disconnect()
    assert "work failed" in caplog.text
