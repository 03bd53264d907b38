"""Remote tensors: a tensor subclass whose every ATen op is forwarded to the server.

A :class:`RemoteTensor` holds no data, only metadata (dtype, shape, strides) and the handle of
the real tensor on the server. ``__torch_dispatch__`` sees every ATen op below autograd; for each
it finds the output metadata in the :class:`~gpu_trace.runtime.protocol.shapes.ShapeCache`,
allocates handles for new outputs and appends the op to the connection's pending batch without
waiting.

Where a value is read the client waits: ``.item()``/``bool()`` (``_local_scalar_dense`` and
other ops with non-tensor results), ``.cpu()``/``.tolist()``/printing (a fetch), and ops whose
output shape depends on data (run at once, their shapes asked from the server).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, cast

import torch

from gpu_trace.runtime.client import profiler_memory
from gpu_trace.runtime.client.connection import Connection, OpRecord, now_ns
from gpu_trace.runtime.client.signatures import Call, Many, One, cache, miss
from gpu_trace.runtime.protocol.errors import RemoteError, ServerGone
from gpu_trace.runtime.protocol.shapes import (
    DYNAMIC,
    Alias,
    NewTensor,
)
from gpu_trace.runtime.protocol.templates import numbers
from gpu_trace.runtime.protocol.values import (
    DTYPE_NAMES,
    DTYPES,
    decode_result,
    encode_scalar_like,
    tensor_bytes,
)
from gpu_trace.runtime.protocol.values import (
    _load as _load_values,
)
from gpu_trace.runtime.protocol.wire import wire_name

aten = torch.ops.aten
_load_values()
_getframe = sys._getframe

#: The active connection (one remote device per process).
conn: Connection | None = None
#: Opens the session at the device's first use where it is not open yet (transparent mode:
#: ``device.defer``), or None.
on_demand: Callable[[], Connection] | None = None
#: The parent's pid in a process forked from one with an open session (which it cannot use).
forked_from: int | None = None
#: True in transparent mode, where remote tensors stand for CUDA tensors (``.is_cuda``).
cuda_alias = False
DEVICE = torch.device("privateuseone", 0)  # replaced by device.register() with remote:0
#: Ready plans by signature key, the shape cache's own dict (signatures.py).
_plans: dict[Any, Any] = cache.plans

_kinds: dict[Any, str] = {}
_names: dict[Any, str] = {}
#: Ops whose non-tensor result depends only on metadata: asked once per signature.
_METADATA_QUERIES = {aten._fused_sdp_choice.default}
_query_cache: dict[Any, Any] = {}


class _Handle:
    """The server-side handle of one remote tensor; freed (batched) when the tensor dies.

    ``sig`` is the tensor's part of a shape-cache key, ``wire`` its argument form (made once).
    """

    __slots__ = ("conn", "id", "sig", "wire", "nbytes")

    def __init__(self, c: Connection, ident: int, sig: tuple, nbytes: int = 0) -> None:
        self.conn = c
        self.id = ident
        self.sig = sig
        self.wire = {"h": ident}
        self.nbytes = nbytes  # its own storage's (0: a view, or empty)
        if nbytes:
            c.allocated += nbytes
            if _profiling._is_profiler_enabled:
                profiler_memory.report(id(self), nbytes, c.allocated)

    def __del__(self) -> None:
        c = self.conn
        if not c.closed:
            c.frees.append(self.id)
        if self.nbytes:
            c.allocated -= self.nbytes
            try:
                if _profiling._is_profiler_enabled:
                    profiler_memory.report(id(self), -self.nbytes, max(0, c.allocated))
            except Exception:  # at interpreter exit, what it reads may be gone
                pass


#: Where torch says whether a profiler is on (read per tensor made: no call).
_profiling = torch.autograd.profiler

#: ``Tensor.data``, the base class's attribute (``RemoteTensor.data`` extends its setter).
_TENSOR_DATA: Any = vars(torch._C.TensorBase)["data"]


class RemoteTensor(torch.Tensor):
    """A tensor that lives on the forwarding server."""

    # torch's stubs type these hooks for its own Tensor, not for a wrapper subclass
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]
    _rt: _Handle

    @staticmethod
    def __new__(
        cls,
        c: Connection,
        ident: int,
        dtype: Any,
        shape: tuple,
        stride: tuple,
        offset: int,
        nbytes: int | None = None,
    ):
        """``nbytes``: its storage's bytes, 0 for a view (None: a new storage, sized here)."""
        r = torch.Tensor._make_wrapper_subclass(
            cls, shape, strides=stride, storage_offset=offset, dtype=dtype, device=DEVICE
        )
        if nbytes is None:
            nbytes = profiler_memory.storage_bytes(dtype, shape, stride, offset)
        r._rt = _Handle(c, ident, (dtype, shape, stride, offset), nbytes)
        return r

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        return _dispatch(cls, func, types, args, kwargs)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        text = repr(self.detach().cpu())
        return text[:-1] + f", device='{self.device}')" if text.endswith(")") else text

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return cuda_alias

    @property
    def data(self) -> torch.Tensor:
        return _TENSOR_DATA.__get__(self)

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        # ``param.data = new`` replaces the tensor inside ``param`` (``Module.half()`` and
        # ``.to(dtype)`` do it to each parameter); the handle is ours, not the tensor's, so it
        # follows: else ``param`` would say ``new``'s dtype and shape and be the old tensor on
        # the server.
        _TENSOR_DATA.__set__(self, new)
        if type(new) is RemoteTensor:
            self._rt = new._rt

    def tolist(self) -> Any:
        return self.detach().cpu().tolist()

    def numpy(self, *, force: bool = False) -> Any:
        return self.detach().cpu().numpy()

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.detach().cpu().__reduce_ex__(protocol)


def _new(c: Connection, plan: NewTensor, owns: bool = True) -> tuple[int, RemoteTensor]:
    """A new handle and its tensor; ``owns``: it has a storage of its own (not a view)."""
    h = c.new_handle()
    dtype, shape, stride, offset = plan
    return h, RemoteTensor(c, h, dtype, shape, stride, offset, None if owns else 0)


def _stack() -> tuple:
    """The issuing stack, cheaply: ``(code, lasti, code, lasti, ...)`` of the innermost frames,
    innermost first; :func:`~gpu_trace.runtime.protocol.errors.user_frames` turns it into lines,
    only for an op that failed (``f_lineno`` decodes the line table: it cost more than the rest).

    In sync mode errors are raised where the op is issued, so no stack is kept.
    """
    c = conn
    if c is not None and c.sync:
        return ()
    f = _getframe(1).f_back  # the caller's caller (none on the autograd engine's thread)
    if f is None:
        return ()
    g = f.f_back
    if g is None:
        return (f.f_code, f.f_lasti)
    h = g.f_back
    if h is None:
        return (f.f_code, f.f_lasti, g.f_code, g.f_lasti)
    i = h.f_back
    if i is None:
        return (f.f_code, f.f_lasti, g.f_code, g.f_lasti, h.f_code, h.f_lasti)
    j = i.f_back
    if j is None:
        return (f.f_code, f.f_lasti, g.f_code, g.f_lasti, h.f_code, h.f_lasti, i.f_code, i.f_lasti)
    k = j.f_back
    if k is None:
        return (
            *(f.f_code, f.f_lasti, g.f_code, g.f_lasti, h.f_code, h.f_lasti),
            *(i.f_code, i.f_lasti, j.f_code, j.f_lasti),
        )
    return (
        *(f.f_code, f.f_lasti, g.f_code, g.f_lasti, h.f_code, h.f_lasti),
        *(i.f_code, i.f_lasti, j.f_code, j.f_lasti, k.f_code, k.f_lasti),
    )


def _kind(func: Any) -> str:
    kind = _kinds.get(func)
    if kind is None:
        types = [str(r.type) for r in func._schema.returns]
        if not types:
            kind = "none"
        elif all(t in ("Tensor", "Optional[Tensor]", "List[Tensor]") for t in types):
            kind = "tensor"
        elif not any("Tensor" in t for t in types):
            kind = "scalar"
        else:
            kind = "mixed"
        _kinds[func] = kind
        _names[func] = wire_name(func)
    return kind


class _Encoder:
    """One op's arguments: cache key parts, wire form, tensor inputs in order, uploads."""

    __slots__ = ("c", "inputs", "blobs")

    def __init__(self, c: Connection, inputs: list[Any] | None = None) -> None:
        self.c = c
        self.inputs: list[Any] = [] if inputs is None else inputs
        self.blobs: list[tuple[int, str, list[int], bytes]] = []

    def enc(self, x: Any) -> tuple[Any, Any]:
        cls = type(x)
        if cls is RemoteTensor:
            rt = x._rt
            if rt.conn is not self.c:
                raise RemoteError("this remote tensor belongs to a closed or different session")
            self.inputs.append(x)
            return rt.sig, rt.wire
        if cls is int or cls is bool:
            return (cls, x), x
        if cls is float:
            return ((cls, x) if x and x == x else (cls, str(x))), x  # as in _dispatch
        if x is None:
            return None, None
        if cls is list or cls is tuple:
            parts = [self.enc(v) for v in x]
            return (cls, tuple(p[0] for p in parts)), [p[1] for p in parts]
        if isinstance(x, torch.Tensor):
            if x.device.type != "cpu":
                raise RemoteError(f"cannot mix a {x.device} tensor with remote tensors")
            x = x.detach().contiguous()
            self.inputs.append(x)
            ident = self.c.new_handle()
            name = DTYPE_NAMES.get(x.dtype)
            if name is None:
                raise RemoteError(f"dtype {x.dtype} cannot be forwarded")
            self.blobs.append((ident, name, list(x.shape), bytes(tensor_bytes(x))))
            return ("cpu", x.dtype, tuple(x.shape)), {"b": ident}
        if isinstance(x, torch.device):
            return (torch.device, x.type == "cpu"), encode_scalar_like(x)
        if isinstance(x, torch.Generator):
            raise RemoteError(
                "explicit generators cannot be forwarded; seed with torch.manual_seed"
            )
        try:
            wire = encode_scalar_like(x)
        except TypeError as exc:
            raise RemoteError(str(exc)) from None
        return (cls, x), wire


def _session(args: tuple, kwargs: dict) -> Connection:
    c = conn
    if c is None and on_demand is not None:
        c = on_demand()
    if c is None:
        if forked_from is not None:
            raise ServerGone(
                f"this process was forked from process {forked_from}, whose remote session it "
                "cannot use (as CUDA cannot be used again in a forked subprocess): use the "
                "'spawn' start method, or gpu_trace.runtime.connect() in this process"
            )
        raise ServerGone("no remote session: call gpu_trace.runtime.connect() first")
    if c.broken:
        raise ServerGone(c.broken)
    return c


def _op_info(func: Any) -> tuple[Any, str, str]:
    """``(special handler, kind, wire name)`` of an op, kept by the op's id (hashing an
    ``OpOverload`` runs Python code; its id does not, and the op objects live for good)."""
    info = _info.get(id(func))
    if info is None:
        kind = _kind(func)
        info = _info[id(func)] = (_SPECIAL.get(func), kind, _names[func])
        _keep.append(func)
    return info


def dispatch(func: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """Forward one ATen op on remote tensors (see the module docstring)."""
    return _dispatch(RemoteTensor, func, (), args, kwargs)


def _dispatch(cls: Any, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
    """:func:`dispatch`, with ``__torch_dispatch__``'s arguments.

    The common case, an op whose arguments are remote tensors and plain numbers with a plan
    already made for its signature, is one loop over the arguments, one dict lookup and, per
    new result, a wrapper tensor and a handle number.
    """
    t0 = now_ns()
    c = conn
    if c is None or c.broken:
        c = _session(args, kwargs)
    info = _info.get(id(func))
    if info is None:
        info = _op_info(func)
    special, kind, name = info
    if special is not None:
        result = special(c, func, args, kwargs or {}, t0)
        if result is not NotImplemented:
            return result
    # Arguments: remote tensors and plain numbers inline, anything else through the encoder.
    # ``nums``: the handle numbers of a template call (when all arguments were inline).
    inputs: list[Any] = []
    e: Any = _NO_ENCODER
    key: list[Any] = [id(func)]
    wire_args = []
    nums: list[int] | None = []
    for a in args:
        t = type(a)
        if t is RemoteTensor:
            rt = a._rt
            if rt.conn is not c:
                raise RemoteError("this remote tensor belongs to a closed or different session")
            inputs.append(a)
            key.append(rt.sig)
            wire_args.append(rt.wire)
            nums.append(rt.id)  # type: ignore[union-attr]
        elif t is int or t is bool:
            key.append((t, a))
            wire_args.append(a)
        elif t is float:
            # 0.0 == -0.0: a template keeps the value, so the key tells them apart; and a NaN
            # equals nothing, so it is keyed by its text (one plan for every NaN, not one each).
            key.append((t, a) if a and a == a else (t, str(a)))
            wire_args.append(a)
        else:
            if e is _NO_ENCODER:
                e = _Encoder(c, inputs)
            sig, w = e.enc(a)
            key.append(sig)
            wire_args.append(w)
    wire_kwargs = {}
    if kwargs:
        if e is _NO_ENCODER:
            e = _Encoder(c, inputs)
        enc = e.enc
        for k, v in kwargs.items():
            sig, w = enc(v)
            key.append((k, sig))
            wire_kwargs[k] = w
    if e is not _NO_ENCODER:
        nums = None  # found in the wire form, if the op goes as a template call
    if kind == "tensor":
        plan = _plans.get(tuple(key))
        if plan is None:
            plan = miss(c, func, args, kwargs or {}, tuple(key), name, kind)
        if type(plan) is One:  # one new tensor: most ops
            ident = next(c.ids)
            out = _make(c, ident, plan)
            record = OpRecord(name, _stack(), t0)
            _send(c, plan, record, wire_args, wire_kwargs, [ident], nums, e)
            return out
        if plan is DYNAMIC:
            return _dynamic(c, func, name, wire_args, wire_kwargs, e, t0)
        return _issue_plan(c, cast(Many, plan), name, wire_args, wire_kwargs, inputs, nums, e, t0)
    if kind == "none":  # in-place list ops (``_foreach_add_``...): a template call, no reply
        key_t = tuple(key)
        plan = _plans.get(key_t)
        if plan is None:
            plan = miss(c, func, args, kwargs or {}, key_t, name, kind)
        record = OpRecord(name, _stack(), t0)
        _send(c, cast(Call, plan), record, wire_args, wire_kwargs, None, nums, e)
        return None
    if kind == "scalar":
        key_t = tuple(key)
        if func in _METADATA_QUERIES and key_t in _query_cache:
            return _query_cache[key_t]
        plan = _plans.get(key_t)
        if plan is None:
            plan = Call()
            cache.put(key_t, plan)
        record = OpRecord(name, _stack(), t0)
        seq = _send(c, plan, record, wire_args, wire_kwargs, None, nums, e, True)
        c.wait(seq, "item" if "scalar" in name else name)
        value = decode_result(record.result)
        if func in _METADATA_QUERIES:
            _query_cache[key_t] = value
        return value
    raise NotImplementedError(f"{name} returns tensors and other values: not forwarded")


_mws = torch.Tensor._make_wrapper_subclass


def _make(c: Connection, ident: int, one: One) -> RemoteTensor:
    """The remote tensor of a new result (``one``: its ready plan)."""
    if one.contiguous:
        r = _mws(RemoteTensor, one.shape, dtype=one.dtype, device=DEVICE)
    else:
        r = _mws(
            RemoteTensor,
            one.shape,
            strides=one.stride,
            storage_offset=one.offset,
            dtype=one.dtype,
            device=DEVICE,
        )
    r._rt = _Handle(c, ident, one.sig, one.nbytes)
    return r


def _issue_plan(
    c: Connection,
    plan: Many,
    name: str,
    wire_args: list,
    wire_kwargs: dict,
    inputs: list,
    nums: list[int] | None,
    e: Any,
    t0: int,
) -> Any:
    """Issue an op whose results are not a single new tensor (several, aliases, lists)."""
    outs: list[Any] = []
    results: list[Any] = []
    for d in plan.described:
        if type(d) is NewTensor:
            h, t = _new(c, d, plan.owns)
            outs.append(h)
            results.append(t)
        elif type(d) is Alias:
            outs.append(None)
            results.append(inputs[d])
        elif d is None:
            outs.append(None)
            results.append(None)
        else:
            pairs = [(None, None) if x is None else _new(c, x, plan.owns) for x in d]
            outs.append([h for h, _ in pairs])
            results.append([t for _, t in pairs])
    record = OpRecord(name, _stack(), t0)
    _send(c, plan, record, wire_args, wire_kwargs, outs, nums, e)
    return tuple(results) if plan.is_tuple else results[0]


def _send(
    c: Connection,
    plan: One | Many | Call,
    record: OpRecord,
    wire_args: list,
    wire_kwargs: dict,
    outs: list | None,
    nums: list[int] | None,
    e: Any,
    urgent: bool = False,
) -> int:
    """Issue a planned op: as a call of its template in this session (defined with the next
    batch if it is not yet), or as JSON where the session may define no more; returns its
    batch's seq (``urgent``: the caller waits for it next, so the batch goes now).

    ``nums``: the inputs' handle numbers when every argument was inline (else found in the
    wire form). ``record`` is made by the caller, whose caller is the program (the stack)."""
    name = record.name
    tid = plan.tid if plan.tepoch == c.epoch else c.define(plan, name, wire_args, wire_kwargs, outs)
    if tid:
        if nums is None:
            nums = numbers(wire_args, wire_kwargs, outs)
        elif type(plan) is One:
            nums.append(outs[0])  # type: ignore[index]
        elif outs is not None:
            nums.extend(numbers([], {}, outs))
        record.t1 = now_ns()
        return c.issue_t(tid, nums, record, e.blobs, urgent)
    record.t1 = now_ns()
    return c.issue([name, wire_args, wire_kwargs, outs], record, e.blobs, urgent)


def _dynamic(
    c: Connection, func: Any, name: str, args: Any, kwargs: Any, e: _Encoder, t0: int
) -> Any:
    """Ops without a usable meta result: run now, then ask the server for the output shapes."""
    types = [str(r.type) for r in func._schema.returns]
    if not all(t == "Tensor" for t in types):
        raise NotImplementedError(f"{name}: output shapes depend on data and are not forwarded")
    handles = [c.new_handle() for _ in types]
    stack = _stack()
    c.issue([name, args, kwargs, handles], OpRecord(name, stack, t0), e.blobs)
    records = []
    for h in handles:
        r = OpRecord("rt::meta", stack, now_ns())
        records.append(r)
        seq = c.issue(["rt::meta", [{"h": h}], {}, None], r, urgent=h == handles[-1])
    c.wait(seq, name)
    outs = []
    for h, r in zip(handles, records):
        shape, stride, offset, dtype = r.result
        outs.append(RemoteTensor(c, h, DTYPES[dtype], tuple(shape), tuple(stride), offset))
    return tuple(outs) if len(outs) > 1 else outs[0]


def fetch(c: Connection, t: RemoteTensor, reason: str = "cpu") -> torch.Tensor:
    """The tensor's values, as a new CPU tensor (a sync point)."""
    fid = c.new_handle()
    record = OpRecord("rt::fetch", _stack(), now_ns())
    seq = c.issue(["rt::fetch", [{"h": t._rt.id}, fid], {}, None], record, urgent=True)
    c.wait(seq, reason)
    return c.take_fetch(fid)


# ---- ops with their own handling ---------------------------------------------------------------


def _to_copy(c: Connection, func: Any, args: tuple, kwargs: dict, t0: int) -> Any:
    device = kwargs.get("device")
    if device is None or device.type != "cpu" or type(args[0]) is not RemoteTensor:
        return NotImplemented
    out = fetch(c, args[0])
    dtype = kwargs.get("dtype")
    if dtype is not None and dtype != out.dtype:
        out = out.to(dtype)
    fmt = kwargs.get("memory_format")
    if fmt is not None and fmt != torch.preserve_format:
        out = out.contiguous(memory_format=fmt)
    return out


def _copy_(c: Connection, func: Any, args: tuple, kwargs: dict, t0: int) -> Any:
    dst, src = args[0], args[1]
    if type(dst) is RemoteTensor:
        return NotImplemented
    with torch._C._DisableTorchDispatch():
        dst.copy_(fetch(c, src))
    return dst


_SPECIAL = {aten._to_copy.default: _to_copy, aten.copy_.default: _copy_}
#: Per op, by ``id(op)``: ``(special handler, kind, wire name)``.
_info: dict[int, tuple[Any, str, str]] = {}
#: The ops in ``_info`` (kept alive, so that their ids stay theirs).
_keep: list[Any] = []


class _NoEncoder:
    """The encoder of an op whose arguments were all encoded inline: no uploads."""

    __slots__ = ("blobs", "inputs")

    def __init__(self) -> None:
        self.blobs: list[Any] = []
        self.inputs: list[Any] = []


_NO_ENCODER: Any = _NoEncoder()

# Called by PyTorch directly (no frame of a wrapper between the program and the dispatch).
RemoteTensor.__torch_dispatch__ = classmethod(_dispatch)  # type: ignore[assignment]


def _foreach_capable() -> None:
    """List remote tensors among the types whose optimizers and ``clip_grad_norm_`` default to
    their foreach implementations, as DTensor lists itself.

    The remote device stands for a CUDA one, where PyTorch takes the foreach path by default:
    so a forwarded step computes what the same step computes locally on the GPU, and issues one
    op per parameter group where the loop over tensors issued one per parameter (AdamW: about
    ten per parameter). The lists are PyTorch's private names: where they are missing, the
    optimizers keep their loops.
    """
    import importlib

    for module in ("torch.optim.optimizer", "torch.utils._foreach_utils"):
        types = getattr(importlib.import_module(module), "_foreach_supported_types", None)
        if type(types) is list and RemoteTensor not in types:
            types.append(RemoteTensor)


_foreach_capable()
