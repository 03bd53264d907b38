"""The allow-list is what programs' forwarding sends (runtime/server/allowed_ops.txt, made by
scripts/make_allowlist.py); everything else is refused by name, with why."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gpu_trace import runtime
from gpu_trace.runtime.protocol.errors import RemoteOpError
from gpu_trace.runtime.server import allowlist
from gpu_trace.runtime.server.server import Server
from tests import op_cases

TOKEN = "allowlist-test-token-0123"


def test_the_list_is_sorted_and_admissible() -> None:
    """One name a line, sorted, each an overload this torch has that passes the schema and deny
    checks (what the generator writes); the server allows exactly those."""
    lines = [
        n for n in allowlist.ALLOWED_OPS_FILE.read_text().splitlines() if not n.startswith("#")
    ]
    assert lines == sorted(set(lines))
    assert set(lines) == allowlist.listed()
    assert allowlist.allowed() == allowlist.listed() & allowlist.admissible()
    assert allowlist.listed() <= allowlist.admissible(), "rerun scripts/make_allowlist.py"
    assert 300 < len(allowlist.allowed()) < len(allowlist.admissible()) // 3


def test_every_op_the_programs_send_is_listed() -> None:
    """The op fuzzer's recorded calls come from the same programs as the list."""
    assert set(op_cases.load_samples()) <= allowlist.allowed()


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("aten::segment_reduce.default", "forwarded programs do not send it"),
        ("aten::_cummax_helper.default", "forwarded programs do not send it"),
        ("aten::max_pool2d_with_indices_backward.grad_input", "forwarded programs do not send it"),
        ("aten::from_file.default", "it is denied"),
        ("aten::_unsafe_index.Tensor", "it is denied"),
        ("aten::nope.default", "no such overload"),
        ("builtins::eval", "only aten ops are resolved"),
    ],
)
def test_ops_off_the_list_are_refused_by_name_saying_why(name: str, why: str) -> None:
    assert allowlist.resolve(name) is None
    message = allowlist.refusal(name)
    assert "is not on this server's allow-list" in message and why in message, message


def test_the_public_ops_programs_call_are_allowed_and_their_internals_are_not() -> None:
    """``torch.cummax`` travels as ``cummax``: its helper, which trusted its outputs' shapes
    (heap corruption), is never sent. Backwards autograd sends are in, out= forms of them not."""
    for name in (
        "aten::cummax.default",
        "aten::max_pool2d_with_indices_backward.default",
        "aten::convolution_backward.default",
        "aten::embedding_dense_backward.default",
        "aten::_fused_adamw_.default",
    ):
        assert allowlist.resolve(name) is not None, name
    for name in ("aten::_cummax_helper.default", "aten::_pdist_backward.default"):
        assert allowlist.resolve(name) is None, name


@pytest.fixture
def dev() -> Iterator[torch.device]:
    with Server("127.0.0.1:0", token=TOKEN) as server:
        device = runtime.connect(server.address, token=TOKEN)
        try:
            yield device
        finally:
            runtime.disconnect()


def test_a_program_calling_an_op_off_the_list_gets_the_servers_reason(dev: torch.device) -> None:
    """Through the real client and server: the op error names the op and why, at the next sync
    point, and the session goes on."""
    data = torch.arange(4.0).to(dev)
    out = torch.segment_reduce(data, "sum", offsets=torch.tensor([0, 1 << 20]).to(dev))
    with pytest.raises(RemoteOpError) as info:
        out.sum().item()
    message = str(info.value)
    assert "aten::segment_reduce.default is not on this server's allow-list" in message
    assert "forwarded programs do not send it" in message
    values, indices = torch.cummax(data, 0)
    assert values.tolist() == [0.0, 1.0, 2.0, 3.0] and indices.tolist() == [0, 1, 2, 3]


def test_record_ops_appends_each_name_a_client_asks_for_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPU_TRACE_RECORD_OPS: how scripts/make_allowlist.py collects what the forwarding tests'
    servers are sent (refused names too); the file is opened before a worker is contained."""
    record = tmp_path / "ops.txt"
    monkeypatch.setenv("GPU_TRACE_RECORD_OPS", str(record))
    monkeypatch.setattr(allowlist, "recorder", allowlist._record_to_file())
    for name in ("aten::add.Tensor", "aten::segment_reduce.default", "aten::add.Tensor", 3):
        allowlist.resolve(name)
    assert record.read_text().split() == ["aten::add.Tensor", "aten::segment_reduce.default"]


def test_the_issues_ops_stay_off_the_list_unless_ruled() -> None:
    """Issue 25's crashing and cross-tenant calls are refused by name, but for the ops programs
    do send (the max-pool backwards, the native attention), which have rules. A test that names
    one of the others must be in scripts/make_allowlist.py's NOT_NAMED_IN, or the list grows."""
    ruled = {
        "aten::max_pool2d_with_indices_backward.default",
        "aten::max_pool3d_with_indices_backward.default",
        "aten::adaptive_max_pool2d_backward.default",
        "aten::adaptive_max_pool3d_backward.default",
        "aten::_native_multi_head_attention.default",
    }
    for what, make in op_cases.hostile(torch).items():
        name = make()[0]
        assert (name in allowlist.allowed()) == (name in ruled), (what, name)
