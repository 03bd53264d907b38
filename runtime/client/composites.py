"""Functions that run whole on the server, autograd included.

Some PyTorch functions pick their decomposition by device type: ``LSTMCell`` takes the fused
``_thnn_fused_lstm_cell`` path on any non-CPU device, ``scaled_dot_product_attention`` picks a
kernel by device. Decomposed on the client (a ``remote`` device) they would run ops the server's
device does not have, or other kernels than the same program run on that device. So these
functions travel whole: the server runs them on its device with autograd on, keeps the graph, and
runs its backward when the client's backward reaches them (``rt::fn`` and ``rt::backward``). The
result is exactly what the program computes on the server's device locally.

:func:`patch` swaps the functions in ``torch._VF`` and ``torch.nn.functional`` for wrappers that
pass calls without remote tensors straight through; :func:`unpatch` restores them. Which functions
travel whole, and what the server runs for each, is :mod:`gpu_trace.runtime.protocol.functions`.
"""

from __future__ import annotations

from typing import Any

import torch

from gpu_trace.runtime.client import autocast
from gpu_trace.runtime.client import tensor as rt
from gpu_trace.runtime.client.connection import OpRecord, now_ns
from gpu_trace.runtime.protocol.functions import FUNCTIONS
from gpu_trace.runtime.protocol.functions import ORIGINALS as _originals
from gpu_trace.runtime.protocol.shapes import meta_like

_plans: dict[Any, Any] = {}


def patch() -> None:
    unpatch()
    for name, (owner, attr) in FUNCTIONS.items():
        original = getattr(owner, attr)
        _originals[name] = original
        setattr(owner, attr, _wrapper(name, original))


def unpatch() -> None:
    for name, original in list(_originals.items()):
        owner, attr = FUNCTIONS[name]
        if owner is torch._VF:
            # torch._VF serves its functions through __getattr__: drop the instance attribute.
            owner.__dict__.pop(attr, None)
        else:
            setattr(owner, attr, original)
        del _originals[name]


def is_patched() -> bool:
    return bool(_originals)


def _wrapper(name: str, original: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        if not _has_remote(args) and not _has_remote(kwargs.values()):
            return original(*args, **kwargs)
        args = autocast.cast_whole(name, args, kwargs)  # the server runs it without autocast
        return _remote_call(name, original, args, kwargs)

    call.__wrapped__ = original  # type: ignore[attr-defined]
    call.__name__ = getattr(original, "__name__", name)
    return call


def _has_remote(values: Any) -> bool:
    for v in values:
        if type(v) is rt.RemoteTensor:
            return True
        if type(v) in (list, tuple) and any(type(x) is rt.RemoteTensor for x in v):
            return True
    return False


def _tensors(values: Any, out: list[Any]) -> None:
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif type(v) in (list, tuple):
            _tensors(v, out)


def _remote_call(name: str, original: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    inputs: list[Any] = []
    _tensors((*args, *kwargs.values()), inputs)
    graph = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    spec = (name, original, args, kwargs)
    if graph:
        return _ServerCall.apply(spec, *inputs)
    return _issue(spec, graph_id=0)[0]


def _plan(name: str, original: Any, args: tuple, kwargs: dict[str, Any], key: Any) -> Any:
    plan = _plans.get(key)
    if plan is None:

        def to_meta(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return meta_like(x) if x.device.type != "cpu" else x.to("meta")
            if type(x) in (list, tuple):
                return type(x)(to_meta(v) for v in x)
            return x

        with torch.no_grad():
            out = original(*to_meta(args), **{k: to_meta(v) for k, v in kwargs.items()})
        flat = list(out) if isinstance(out, tuple) else [out]
        plan = (
            isinstance(out, tuple),
            [(o.dtype, tuple(o.shape), tuple(o.stride()), o.storage_offset()) for o in flat],
        )
        _plans[key] = plan
    return plan


def _issue(spec: tuple, graph_id: int) -> tuple[Any, list[Any]]:
    name, original, args, kwargs = spec
    c = rt._session(args, kwargs)
    t0 = now_ns()
    e = rt._Encoder(c)
    sig_args, wire_args = e.enc(args)
    wire_kwargs, sig_kwargs = {}, []
    for k, v in kwargs.items():
        s, w = e.enc(v)
        sig_kwargs.append((k, s))
        wire_kwargs[k] = w
    is_tuple, metas = _plan(name, original, args, kwargs, (name, sig_args, tuple(sig_kwargs)))
    mask = [bool(graph_id) and t.requires_grad for t in e.inputs]
    outs = [c.new_handle() for _ in metas]
    results = [rt.RemoteTensor(c, h, *m) for h, m in zip(outs, metas)]
    record = OpRecord(f"rt::fn:{name}", rt._stack(), t0)
    record.t1 = now_ns()
    c.issue(["rt::fn", [name, wire_args, wire_kwargs, mask, graph_id], {}, outs], record, e.blobs)
    return (tuple(results) if is_tuple else results[0]), e.inputs


class _Graph:
    """The server keeps a call's graph until its backward ran or this object dies."""

    __slots__ = ("conn", "id", "done")

    def __init__(self, c: Any, ident: int) -> None:
        self.conn, self.id, self.done = c, ident, False

    def __del__(self) -> None:
        if not self.done and not self.conn.closed:
            self.conn.frees.append(self.id)


class _ServerCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, spec: tuple, *inputs: Any) -> Any:
        c = rt._session(spec[2], spec[3])
        graph = _Graph(c, c.new_handle())
        out, encoded_inputs = _issue(spec, graph.id)
        ctx.graph = graph
        ctx.metas = [(t.dtype, tuple(t.shape)) for t in inputs]
        return out

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        graph = ctx.graph
        c = graph.conn
        e = rt._Encoder(c)
        _, wire_grads = e.enc(list(grads))
        needs = ctx.needs_input_grad[1:]
        outs = [c.new_handle() if n else None for n in needs]
        record = OpRecord("rt::backward", [], now_ns())
        c.issue(["rt::backward", [graph.id, wire_grads], {}, outs], record, e.blobs)
        graph.done = True
        result: list[rt.RemoteTensor | None] = []
        for h, (dtype, shape) in zip(outs, ctx.metas):
            if h is None:
                result.append(None)
            else:
                stride = torch.empty(shape, device="meta").stride()
                result.append(rt.RemoteTensor(c, h, dtype, shape, stride, 0))
        return (None, *result)
