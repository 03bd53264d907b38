"""Compiled template calls (runtime/server/plan.py) against the general path they shortcut.

A template call runs through :meth:`Plan.run`; the same op sent as a JSON op runs through the
executor's general path (decode, rules, sizing, ``Executor.admit``, the handle table's ``put``).
Both must leave the same handles, the same account and tenant sums, and refuse the same op with
the same quota error. Real executor, real memory book-keeping, real PyTorch on the CPU.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu_trace.runtime.protocol.templates import Templates, define, expand
from gpu_trace.runtime.server.executor import Executor
from gpu_trace.runtime.server.plan import NO_ALLOC, VALUE, Plan
from gpu_trace.runtime.server.sizing import Sizing
from gpu_trace.runtime.sharing.memory import Memory
from gpu_trace.runtime.sharing.scheduler import PolicyScheduler, Work
from gpu_trace.runtime.sharing.sessions import Session
from gpu_trace.runtime.sharing.tenants import Tenant

# ---- a session on a real executor ----------------------------------------------------------------


class Rig:
    """An executor, its memory, and one session of a tenant with ``quota`` bytes."""

    def __init__(self, quota: int | None = None, block: int = 1, device: str = "cpu") -> None:
        scheduler = PolicyScheduler()
        self.memory = Memory(1 << 40, block_bytes=block, wake=scheduler.unpark)
        self.ex = Executor(device, scheduler, memory=self.memory)
        self.device = device
        self.replies: list[bytes] = []
        tenant = Tenant(name="t", token="x" * 24, memory_bytes=quota)
        self.memory.add_tenants([tenant])
        self.session = Session({}, self.replies.append, tenant)
        self.memory.attach(self.session)
        self.templates = Templates()
        self.tids: dict[str, int] = {}
        self.seq = 0

    def put(self, handle: int, tensor: torch.Tensor) -> None:
        self.session.handles.put(handle, tensor.to(self.device))

    def batch(self, ops: list[list[Any]], templated: bool) -> None:
        """Run ``ops`` (wire ops) in one batch: as template calls, or as JSON ops."""
        from gpu_trace.runtime.protocol.templates import make_template, numbers

        self.seq += 1
        if templated:  # one template per wire form, as the client keeps them
            defs, stream = [], []
            for name, args, kwargs, outs in ops:
                form = json.dumps(make_template(0, name, args, kwargs, outs))
                tid = self.tids.get(form)
                if tid is None:
                    tid = self.tids[form] = len(self.tids) + 1
                    defs.append(make_template(tid, name, args, kwargs, outs))
                stream += [tid, *numbers(args, kwargs, outs)]
            define(self.templates, defs)
            body = b"".join(v.to_bytes(8, "little", signed=True) for v in stream)
            head = {"seq": self.seq, "ops": expand(self.templates, body, []), "free": []}
        else:
            head = {"seq": self.seq, "ops": ops, "free": []}
        self.ex.run(self.session, Work("batch", head))
        assert not self.session.closed

    def state(self) -> dict[str, Any]:
        """What both paths must agree on."""
        s = self.session
        tm = self.memory.tenants["t"]
        handles = {h: (t.dtype, t.shape, t.stride()) for h, t in s.handles.items()}
        return {
            "handles": handles,
            "bytes": s.account.bytes,
            "peak": s.account.peak_bytes,
            "tenant": tm.used_bytes,
            "device": self.memory.used_bytes,
            "sharing": sorted(
                [
                    h
                    for h, _ in s.handles.items()
                    if h != hh and s.handles.key(h) == s.handles.key(hh)
                ]
                for hh, _ in s.handles.items()
            ),
        }

    def values(self) -> dict[int, torch.Tensor]:
        return {h: t.cpu() for h, t in self.session.handles.items()}

    def drain(self) -> list[tuple[int, int]]:
        """Free every handle, one at a time: the account's bytes and the tenant's after each
        (a view's storage is counted once, and released with its last handle)."""
        out = []
        for handle, _ in self.session.handles.items():
            self.session.free(handle)
            out.append((self.session.account.bytes, self.memory.tenants["t"].used_bytes))
        return out


def _h(n: int) -> dict[str, int]:
    return {"h": n}


#: A few steps of a training loop's kinds of ops, as the client sends them: allocating ops (one
#: output, several outputs), views, in-place updates (nothing kept), a scalar read, ops on
#: lists of tensors (``_foreach_``, ``cat``).
STEP: list[list[Any]] = [
    ["aten::mm.default", [_h(1), _h(2)], {}, [10]],
    ["aten::t.default", [_h(10)], {}, [11]],
    ["aten::addmm.default", [_h(3), _h(11), _h(2)], {}, [12]],
    ["aten::relu.default", [_h(12)], {}, [13]],
    ["aten::view.default", [_h(13), [64]], {}, [14]],
    ["aten::detach.default", [_h(14)], {}, [15]],
    ["aten::add_.Tensor", [_h(1), _h(13)], {"alpha": 0.5}, [None]],
    ["aten::mul_.Scalar", [_h(2), 0.9], {}, [None]],
    ["aten::max.dim", [_h(13), 1, False], {}, [16, 17]],
    ["aten::sum.dim_IntList", [_h(10), [0], True], {}, [18]],
    ["aten::_local_scalar_dense.default", [_h(18)], {}, None],
    ["aten::mm.default", [_h(13), _h(13)], {}, [19]],
    ["aten::_foreach_add_.List", [[_h(1), _h(2)], [_h(10), _h(13)]], {}, None],
    ["aten::_foreach_mul_.Scalar", [[_h(1), _h(2)], 0.5], {}, None],
    ["aten::cat.default", [[_h(1), _h(19), _h(2)], 0], {}, [20]],
    ["aten::_foreach_sqrt.default", [[_h(19), _h(20)]], {}, [[21, 22]]],
    ["aten::split.Tensor", [_h(20), 8], {}, [[23, None, 24]]],
]


def _inputs(rig: Rig) -> None:
    g = torch.Generator().manual_seed(0)
    rig.put(1, torch.randn(8, 8, generator=g))
    rig.put(2, torch.randn(8, 8, generator=g))
    rig.put(3, torch.randn(8, generator=g))


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(quota=st.one_of(st.none(), st.integers(0, 5000)), block=st.sampled_from([1, 512]))
def test_compiled_calls_leave_what_json_ops_leave(quota: int | None, block: int) -> None:
    """Same handles, values, account, tenant and device sums, and the same first error (a
    quota error with the same numbers, at the same op), whatever the tenant's quota, with
    storages counted as they are (1) or as CUDA's allocator rounds them (512)."""
    assert_same_as_json_ops(quota, block, "cpu")


def assert_same_as_json_ops(quota: int | None, block: int, device: str, exact: bool = True) -> None:
    """The STEP batch as template calls and as JSON ops, on ``device``: the same outcome
    (``exact``: the same values, bit for bit; else within float32 rounding, and the same kind
    of reply)."""
    got = []
    for templated in (True, False):
        rig = Rig(quota if quota is None else quota + 1536, block, device)  # the inputs fit
        _inputs(rig)
        rig.batch(STEP, templated)
        got.append((rig.state(), rig.values(), rig.replies[-1], rig.drain()))
    (fast, fast_values, fast_reply, fast_frees), (general, general_values, *rest) = got
    general_reply, general_frees = rest
    assert fast == general
    assert fast_values.keys() == general_values.keys()
    for h, value in fast_values.items():
        if exact:  # bit for bit (NaN where both have NaN: sqrt of a negative)
            torch.testing.assert_close(value, general_values[h], rtol=0, atol=0, equal_nan=True)
        else:
            torch.testing.assert_close(
                value, general_values[h], rtol=1e-5, atol=1e-5, equal_nan=True
            )
    assert fast_frees == general_frees
    if exact:
        assert _reply_without_times(fast_reply) == _reply_without_times(general_reply)
    else:
        assert fast_reply[4] == general_reply[4]  # the reply's message type


def _reply_without_times(frame: bytes) -> Any:
    body = frame[5:]
    if body[:1] != b"{":  # binary DONE_OK / DONE_VALUE: seq, five times, then the value
        return body[:8] + body[48:]
    done = json.loads(body)
    done.pop("t")
    return done


def test_a_quota_refusal_on_the_compiled_path_is_the_general_paths() -> None:
    """The check before an allocating call refuses it with the tenant's numbers (the call does
    not run: no handle, no bytes), as Executor.admit does."""
    rig = Rig(quota=256 * 2 + 32 + 100)  # the inputs, and not one more 8x8 float32
    _inputs(rig)
    before = rig.state()
    rig.batch([STEP[0]], templated=True)
    done = json.loads(rig.replies[-1][5:])
    assert done["error"]["type"] == "QuotaError"
    assert done["error"]["quota"] == {
        "tenant": "t",
        "used": 256 * 2 + 32,
        "asked": 256,
        "limit": 256 * 2 + 32 + 100,
        "kind": "quota",
    }
    assert rig.state() == before


def test_compiled_calls_name_unknown_and_reused_handles_as_the_table_does() -> None:
    rig = Rig()
    _inputs(rig)
    rig.batch([["aten::t.default", [_h(99)], {}, [20]]], templated=True)
    assert b"unknown tensor handle 99" in rig.replies[-1]
    rig.batch([["aten::t.default", [_h(1)], {}, [2]]], templated=True)
    assert b"tensor handle 2 is already in use" in rig.replies[-1]
    rig.batch([["aten::t.default", [_h(1)], {}, [0]]], templated=True)
    assert b"output handles must be positive integers" in rig.replies[-1]
    assert sorted(h for h, _ in rig.session.handles.items()) == [1, 2, 3]


def test_the_common_calls_take_the_compiled_path() -> None:
    """One output kept, or one not kept (in-place): Plan.run; several outputs: the general
    path with the same plan."""
    rig = Rig()
    _inputs(rig)
    rig.batch(STEP, templated=True)
    plans = {t.name: t.prep for t in rig.templates.values()}
    assert all(type(p) is Plan for p in plans.values())
    assert plans["aten::mm.default"].out >= 0
    assert plans["aten::add_.Tensor"].out != -1
    assert plans["aten::max.dim"].out == -1
    assert plans["aten::_foreach_add_.List"].out == VALUE  # nothing kept
    assert plans["aten::_foreach_add_.List"].lists == ((0, (0, 1)), (1, (2, 3)))
    assert plans["aten::cat.default"].out >= 0 and plans["aten::cat.default"].lists
    assert plans["aten::_foreach_sqrt.default"].out == -1  # a list kept: the general path


# ---- ops that never allocate ---------------------------------------------------------------------


def _x() -> torch.Tensor:
    return torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)


#: A call of each op of NO_ALLOC: its arguments (the first is the tensor it views or changes).
SAMPLES: dict[str, Any] = {
    "aten::t.default": lambda: [torch.ones(3, 4)],
    "aten::detach.default": lambda: [_x()],
    "aten::view.default": lambda: [_x(), [6, 4]],
    "aten::view.dtype": lambda: [_x(), torch.int32],
    "aten::alias.default": lambda: [_x()],
    "aten::_reshape_alias.default": lambda: [_x(), [6, 4], [4, 1]],
    "aten::expand.default": lambda: [torch.ones(1, 4), [5, 4]],
    "aten::permute.default": lambda: [_x(), [2, 0, 1]],
    "aten::transpose.int": lambda: [_x(), 0, 2],
    "aten::unsqueeze.default": lambda: [_x(), 1],
    "aten::squeeze.default": lambda: [torch.ones(1, 3, 1)],
    "aten::squeeze.dim": lambda: [torch.ones(1, 3), 0],
    "aten::squeeze.dims": lambda: [torch.ones(1, 3, 1), [0, 2]],
    "aten::select.int": lambda: [_x(), 1, 2],
    "aten::slice.Tensor": lambda: [_x(), 2, 1, 3, 1],
    "aten::diagonal.default": lambda: [torch.ones(4, 4), 0, 0, 1],
    "aten::as_strided.default": lambda: [_x(), [2, 2], [4, 1], 2],
    "aten::unfold.default": lambda: [_x(), 2, 2, 1],
    "aten::view_as_real.default": lambda: [torch.ones(3, dtype=torch.complex64)],
    "aten::view_as_complex.default": lambda: [torch.ones(3, 2)],
    "aten::add_.Tensor": lambda: [_x(), torch.ones(4)],
    "aten::add_.Scalar": lambda: [_x(), 2.0],
    "aten::sub_.Tensor": lambda: [_x(), torch.ones(4)],
    "aten::sub_.Scalar": lambda: [_x(), 2.0],
    "aten::mul_.Tensor": lambda: [_x(), torch.ones(4)],
    "aten::mul_.Scalar": lambda: [_x(), 2.0],
    "aten::div_.Tensor": lambda: [_x(), torch.ones(4)],
    "aten::div_.Scalar": lambda: [_x(), 2.0],
    "aten::addcmul_.default": lambda: [_x(), torch.ones(4), torch.ones(3, 4)],
    "aten::addcdiv_.default": lambda: [_x(), torch.ones(4), torch.ones(3, 4)],
    "aten::lerp_.Scalar": lambda: [_x(), torch.ones(4), 0.5],
    "aten::lerp_.Tensor": lambda: [_x(), torch.ones(4), torch.full((4,), 0.5)],
    "aten::zero_.default": lambda: [_x()],
    "aten::fill_.Scalar": lambda: [_x(), 1.0],
    "aten::copy_.default": lambda: [_x(), torch.ones(4, dtype=torch.float64)],
    "aten::sqrt_.default": lambda: [_x()],
    "aten::neg_.default": lambda: [_x()],
    "aten::relu_.default": lambda: [_x()],
    "aten::clamp_.default": lambda: [_x(), 1.0, 5.0],
    "aten::clamp_min_.default": lambda: [_x(), 1.0],
}


def test_every_no_alloc_op_has_a_sample() -> None:
    assert set(SAMPLES) == set(NO_ALLOC)


@pytest.mark.parametrize("name", sorted(NO_ALLOC))
def test_no_alloc_ops_are_allowed_and_allocate_nothing(name: str) -> None:
    """Each is on the allow-list, its result lies in its first argument's storage, and the
    executor's own sizing (the op on meta tensors) says it allocates nothing."""
    from gpu_trace.runtime.server import allowlist
    from gpu_trace.runtime.server.sizing import sizer

    target = allowlist.resolve(name)
    assert target is not None
    args = SAMPLES[name]()
    base = args[0].untyped_storage().data_ptr()
    result = target(*args)
    assert result.untyped_storage().data_ptr() == base
    size = sizer(target)
    assert Sizing().op_bytes(size, target._op, SAMPLES[name](), {}) == 0


# ---- storages grown in place ---------------------------------------------------------------------


@pytest.mark.parametrize("templated", [True, False])
def test_a_storage_grown_in_place_is_counted_and_held_to_the_quota(templated: bool) -> None:
    """``resize_`` grows a tensor's storage in place: the account counts it at its new size
    (it stayed at the old one: a tenant grew storages past its quota, each growth checked
    against an account that never saw the ones before), for every handle that shares it."""
    rig = Rig(quota=6000)
    rig.put(1, torch.ones(4))
    rig.put(2, torch.ones(4))
    rig.batch([["aten::view.default", [_h(1), [2, 2]], {}, [3]]], templated)  # shares 1's storage
    rig.batch([["aten::resize_.default", [_h(1), [1000]], {}, [None]]], templated)
    assert b'"ok":true' in rig.replies[-1]
    assert rig.session.account.bytes == 4000 + 16
    assert rig.memory.tenants["t"].used_bytes == 4000 + 16
    rig.batch([["aten::resize_.default", [_h(2), [1000]], {}, [None]]], templated)
    assert b"QuotaError" in rig.replies[-1]  # 4016 held + 3984 more > 6000
    assert rig.session.account.bytes == 4000 + 16
    rig.session.free(1)
    assert rig.session.account.bytes == 4000 + 16  # handle 3 holds the grown storage still
    rig.session.free(3)
    assert rig.session.account.bytes == 16


def test_an_out_argument_grown_by_the_op_is_counted() -> None:
    """``out=`` of the wrong size: the op resizes it (a JSON op: its out names a handle)."""
    rig = Rig()
    rig.put(1, torch.ones(100))
    rig.put(2, torch.empty(0))
    rig.batch([["aten::add.out", [_h(1), _h(1)], {"out": _h(2)}, [None]]], templated=False)
    assert b'"ok":true' in rig.replies[-1]
    assert rig.session.handles.get(2).shape == (100,)
    assert rig.session.account.bytes == 400 + 400


def test_a_list_of_tensors_is_sized_by_its_tensors_on_each_call() -> None:
    """One ``cat`` template called on small then large tensors: the second call is checked for
    what it will make (its own signature), not for what the first made."""
    rig = Rig(quota=2176 + 128 + 1000)  # the inputs, the small cat, not the large one
    rig.put(1, torch.ones(2, 8))
    rig.put(2, torch.ones(2, 8))
    rig.put(3, torch.ones(32, 8))
    rig.put(4, torch.ones(32, 8))
    rig.batch([["aten::cat.default", [[_h(1), _h(2)], 0], {}, [5]]], templated=True)
    rig.batch([["aten::cat.default", [[_h(3), _h(4)], 0], {}, [6]]], templated=True)
    assert len(rig.templates) == 1
    done = json.loads(rig.replies[-1][5:])
    assert done["error"]["quota"]["asked"] == 64 * 8 * 4
    assert rig.session.handles.key(6) is None
    assert rig.session.account.peak_bytes == 2176 + 128  # refused before it allocated


@pytest.mark.parametrize("templated", [True, False])
def test_sizes_beyond_the_plain_bound_are_refused_on_both_paths(templated: bool) -> None:
    """A size argument of 2**40 elements (a template's constant: checked once for its plan)
    is refused before anything is sized or allocated, call after call."""
    rig = Rig()
    rig.put(1, torch.ones(4))
    huge = [1 << 20, 1 << 20]
    for _ in range(2):
        rig.batch([["aten::expand.default", [_h(1), [*huge, 4]], {}, [5]]], templated)
        assert b"elements is beyond the server's limit" in rig.replies[-1]
        rig.batch([["aten::empty.memory_format", [huge], {}, [6]]], templated)
        assert b"elements is beyond the server's limit" in rig.replies[-1]
    assert sorted(h for h, _ in rig.session.handles.items()) == [1]
    assert rig.session.account.peak_bytes == 16
