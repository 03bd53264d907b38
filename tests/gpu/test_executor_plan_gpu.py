"""Compiled template calls (runtime/server/plan.py) on a CUDA device: they leave what the same
ops sent as JSON ops leave (handles, the account with storages rounded to the CUDA allocator's
512-byte blocks, tenant sums, frees), under a quota or none. The CPU version of this test is
tests/unit/test_executor_plan.py; here the executor runs on cuda:0 with its per-session stream."""

from __future__ import annotations

import pytest

from tests.unit.test_executor_plan import Rig, _h, _inputs, assert_same_as_json_ops

torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("torch here has no CUDA")


@pytest.mark.parametrize("quota", [None, 0, 700, 1500, 2600])
def test_compiled_calls_leave_what_json_ops_leave_on_cuda(quota: int | None) -> None:
    assert_same_as_json_ops(quota, 512, "cuda:0", exact=False)


def test_compiled_calls_name_unknown_handles_on_cuda() -> None:
    rig = Rig(block=512, device="cuda:0")
    _inputs(rig)
    rig.batch([["aten::t.default", [_h(99)], {}, [20]]], templated=True)
    assert b"unknown tensor handle 99" in rig.replies[-1]
    rig.batch([["aten::mm.default", [_h(1), _h(2)], {}, [20]]], templated=True)
    assert rig.session.handles.get(20).device.type == "cuda"
    assert rig.session.account.bytes == 4 * 512  # three inputs and the product, 512 each
