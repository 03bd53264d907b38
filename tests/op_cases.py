"""Structured cases for the op fuzzer (tests/op_fuzz.py): valid calls with one hostile value.

Random shapes rarely reach the kernels that trust their indices: a max pool's backward needs a
gradient, an input and indices that agree before it reads an index at all. So each allowed op the
programs of scripts/allowlist_programs.py send is fuzzed from a call they made: its first call on
CPU tensors, recorded by ``scripts/make_allowlist.py`` into ``tests/data/op_samples.json``
(integer and boolean tensors with their values, floating ones as dtype and shape only: they are
filled with seeded numbers in [0, 1)). :func:`variants` then changes ONE thing of that call:

- an index tensor (any integer dtype): one element set to 2**40, -1, int64's least, or an exact
  bound (each size, plane and element count of the call's tensors);
- an integer argument, or one element of an integer list: 2**40, -1, int64's least, one more;
- a tensor argument: one row short, or empty (kernels that take a size from one tensor and walk
  another: ``_pdist_backward`` read past a short gradient).

:data:`HOSTILE` adds calls found to crash or reach another tenant's memory (issue 25): each must be
refused, by the allow-list or a rule.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "tests" / "data" / "op_samples.json"
#: Larger integer tensors are kept as zeros (a valid index almost everywhere): the file stays small.
MAX_VALUES = 4096
BIG = 1 << 40
INT64_MIN = -(1 << 63)


# ---- recording and storing calls ----------------------------------------------------------------


def _encode(torch: Any, v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        t = v.detach()
        floating = t.is_floating_point() or t.is_complex()
        out = {
            "tensor": str(t.dtype)[6:],
            "shape": list(t.shape),
            "stride": list(t.stride()),
            "offset": t.storage_offset(),
        }
        if not floating and t.numel() <= MAX_VALUES:
            out["values"] = t.reshape(-1).tolist()
        return out
    if isinstance(v, torch.dtype):
        return {"dtype": str(v)[6:]}
    if isinstance(v, torch.device):
        return {"device": "cpu"}
    if isinstance(v, torch.layout):
        return {"layout": str(v)[6:]}
    if isinstance(v, torch.memory_format):
        return {"memory_format": str(v)[6:]}
    if isinstance(v, (list, tuple)):
        return [_encode(torch, x) for x in v]
    if isinstance(v, float) and v != v:
        return {"float": "nan"}
    if isinstance(v, float) and v in (float("inf"), float("-inf")):
        return {"float": str(v)}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(f"cannot store {type(v).__name__}")


def decode_call(torch: Any, call: list[Any], gen: Any) -> tuple[list[Any], dict[str, Any]]:
    """A stored call's ``(args, kwargs)`` (see :func:`decode`)."""
    args, kwargs = call
    return decode(torch, args, gen), {k: decode(torch, v, gen) for k, v in kwargs.items()}


def decode(torch: Any, v: Any, gen: Any) -> Any:
    """A stored value back; floating tensors get numbers in [0, 1) from ``gen``."""
    if type(v) is list:
        return [decode(torch, x, gen) for x in v]
    if type(v) is not dict:
        return v
    if "tensor" in v:
        dtype = getattr(torch, v["tensor"])
        shape, stride, offset = v["shape"], v["stride"], v["offset"]
        extent = offset + sum((n - 1) * s for n, s in zip(shape, stride)) + 1
        if any(n == 0 for n in shape):
            extent = offset
        base = torch.zeros(max(extent, 0), dtype=dtype)
        if dtype.is_floating_point or dtype.is_complex:
            base.copy_(torch.rand(base.shape, generator=gen).to(dtype))
        if "values" in v and extent > 0:
            # Through the element positions: an expanded tensor (stride 0) has fewer places
            # than values, all equal.
            at = torch.arange(extent).as_strided(shape, stride, offset).reshape(-1)
            base[at] = torch.tensor(v["values"], dtype=dtype)
        return base.as_strided(shape, stride, offset)
    if "dtype" in v:
        return getattr(torch, v["dtype"])
    if "device" in v:
        return torch.device("cpu")
    if "layout" in v:
        return getattr(torch, v["layout"])
    if "memory_format" in v:
        return getattr(torch, v["memory_format"])
    if "float" in v:
        return float(v["float"])
    raise ValueError(f"not a stored value: {v}")


def recorder(
    torch: Any,
    calls: dict[str, Any],
    keep: Callable[[str], bool],
    each: Callable[[str, list[Any], dict[str, Any]], None] | None = None,
) -> Any:
    """A ``TorchDispatchMode`` storing each kept op's first call into ``calls`` (by name), and
    showing ``each`` every call first."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
            schema = func._schema
            name = f"{schema.name}.{schema.overload_name or 'default'}"
            if each is not None:
                each(name, list(args), dict(kwargs or {}))
            if name not in calls and keep(name):
                try:
                    stored = {k: _encode(torch, v) for k, v in (kwargs or {}).items()}
                    calls[name] = [_encode(torch, list(args)), stored]
                except TypeError:  # a value the file cannot hold: no sample for this op
                    calls[name] = None
            return func(*args, **(kwargs or {}))

    return Record()


def write_samples(calls: dict[str, Any], path: Path = SAMPLES) -> None:
    kept = {k: v for k, v in sorted(calls.items()) if v is not None}
    path.write_text(json.dumps(kept, separators=(",", ":"), sort_keys=True) + "\n")


def load_samples(path: Path = SAMPLES) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


# ---- one hostile value at a time --------------------------------------------------------------------


def _bounds(torch: Any, tensors: list[Any]) -> list[int]:
    """Every size, last-2 and last-3 plane and element count of the call's tensors."""
    out: set[int] = set()
    for t in tensors:
        shape = list(t.shape)
        out.update(shape)
        out.add(t.numel())
        for k in (2, 3):
            if len(shape) >= k:
                n = 1
                for d in shape[-k:]:
                    n *= d
                out.add(n)
    return sorted(out)


def _tensors(torch: Any, value: Any) -> Iterator[Any]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list):
        for v in value:
            yield from _tensors(torch, v)


def _set(container: Any, key: Any, value: Any) -> Any:
    c = list(container) if type(container) is list else dict(container)
    c[key] = value
    return c


def _poke(torch: Any, t: Any, value: int) -> Any:
    """A copy of index tensor ``t`` with its first element ``value`` (clamped to its dtype)."""
    info = torch.iinfo(t.dtype)
    out = t.clone()
    out[(0,) * out.dim()] = min(max(value, info.min), info.max)
    return out


def _shorter(torch: Any, t: Any) -> list[tuple[str, Any]]:
    if t.dim() == 0 or t.shape[0] == 0:
        return []
    return [("one row short", t[:-1].clone()), ("empty", t[:0].clone())]


def variants(torch: Any, schema: Any, args: list[Any], kwargs: dict[str, Any]) -> list[Any]:
    """``(what, args, kwargs)``: the call with one value made hostile (see the module doc)."""
    out: list[Any] = []
    tensors = list(_tensors(torch, [args, list(kwargs.values())]))
    bounds = _bounds(torch, tensors)
    for i, arg in enumerate(schema.arguments):
        if arg.is_out:
            continue
        where: tuple[Any, Any]
        if i < len(args) and not arg.kwarg_only:
            where, value = (args, i), args[i]
        elif arg.name in kwargs:
            where, value = (kwargs, arg.name), kwargs[arg.name]
        else:
            continue

        def put(v: Any, what: str, where: Any = where) -> None:
            container, key = where
            changed = _set(container, key, v)
            if container is args:
                out.append((what, changed, kwargs))
            else:
                out.append((what, args, changed))

        name = arg.name
        if type(value) is int:
            for v in (BIG, -1, INT64_MIN, value + 1):
                put(v, f"{name}={v}")
        elif type(value) is list and value and all(type(x) is int for x in value):
            for j, x in enumerate(value):
                for v in (BIG, -1, INT64_MIN, x + 1):
                    put(_set(value, j, v), f"{name}[{j}]={v}")
        elif isinstance(value, torch.Tensor):
            floating = value.is_floating_point() or value.is_complex()
            if value.numel() and not floating and value.dtype != torch.bool:
                for v in (BIG, -1, INT64_MIN, *bounds):
                    put(_poke(torch, value, v), f"{name}[0]={v}")
            for what, t in _shorter(torch, value):
                put(t, f"{name} {what}")
        elif type(value) is list:
            for j, t in enumerate(value):
                if not isinstance(t, torch.Tensor):
                    continue
                if t.numel() and not t.is_floating_point() and t.dtype != torch.bool:
                    for v in (BIG, -1, INT64_MIN, *bounds):
                        put(_set(value, j, _poke(torch, t, v)), f"{name}[{j}][0]={v}")
                for what, s in _shorter(torch, t):
                    put(_set(value, j, s), f"{name}[{j}] {what}")
    return out


# ---- calls that crashed the server or reached another tenant (issue 25) ----------------------------


def _pool(
    torch: Any, dims: int, adaptive: bool, bad: int, out_form: bool
) -> tuple[str, list, dict]:
    x = torch.rand((1, 2) + (4,) * dims)
    aten = torch.ops.aten
    if adaptive:
        fwd = aten.adaptive_max_pool2d if dims == 2 else aten.adaptive_max_pool3d
        y, idx = fwd.default(x, [2] * dims)
        name = f"adaptive_max_pool{dims}d_backward"
        args = [torch.ones_like(y), x, idx]
    else:
        fwd = aten.max_pool2d_with_indices if dims == 2 else aten.max_pool3d_with_indices
        y, idx = fwd.default(x, [2] * dims, [2] * dims, [0] * dims, [1] * dims, False)
        name = f"max_pool{dims}d_with_indices_backward"
        args = [torch.ones_like(y), x, [2] * dims, [2] * dims, [0] * dims, [1] * dims, False, idx]
    idx.view(-1)[0] = bad
    kwargs = {}
    if out_form:
        kwargs["grad_input"] = torch.zeros_like(x)
    return f"aten::{name}.{'grad_input' if out_form else 'default'}", args, kwargs


def _hostile(torch: Any) -> dict[str, Callable[[], tuple[str, list, dict]]]:
    long = torch.long
    return {
        # Reads: segment_reduce returned data[offsets[i]] for any int64 offsets.
        "segment_reduce reads another tenant": lambda: (
            "aten::segment_reduce.default",
            [torch.rand(4), "sum"],
            {"offsets": torch.tensor([0, 1 << 20], dtype=long), "axis": 0},
        ),
        "segment_reduce offsets 2**40": lambda: (
            "aten::segment_reduce.default",
            [torch.rand(4), "sum"],
            {"offsets": torch.tensor([0, BIG], dtype=long)},
        ),
        "_segment_reduce_backward": lambda: (
            "aten::_segment_reduce_backward.default",
            [torch.ones(1), torch.ones(1), torch.rand(4), "sum"],
            {"offsets": torch.tensor([0, BIG], dtype=long)},
        ),
        # Writes: grad_input.flat[indices[i]] += grad[i], grad_input another tenant's tensor.
        "max_pool2d backward writes another tenant": lambda: _pool(torch, 2, False, 1 << 12, True),
        "max_pool2d backward 2**40": lambda: _pool(torch, 2, False, BIG, False),
        "max_pool3d backward 2**40": lambda: _pool(torch, 3, False, BIG, False),
        "adaptive_max_pool2d backward 2**40": lambda: _pool(torch, 2, True, BIG, False),
        "adaptive_max_pool3d backward 2**40": lambda: _pool(torch, 3, True, BIG, False),
        "max_pool2d backward -1": lambda: _pool(torch, 2, False, -1, False),
        "_embedding_bag_backward": lambda: (
            "aten::_embedding_bag_backward.default",
            [
                torch.ones(2, 3),
                torch.tensor([0, BIG], dtype=long),
                torch.tensor([0, 1]),
                torch.tensor([0, 1]),
                torch.tensor([1, 1]),
                torch.tensor([0, 0]),
                4,
                False,
                0,
                False,
                None,
            ],
            {},
        ),  # fmt: skip
        "_embedding_bag_dense_backward": lambda: (
            "aten::_embedding_bag_dense_backward.default",
            [
                torch.ones(2, 3),
                torch.tensor([0, BIG], dtype=long),
                torch.tensor([0, 1]),
                torch.tensor([1, 1]),
                torch.tensor([0, 0]),
                4,
                False,
                0,
                None,
            ],
            {},
        ),  # fmt: skip
        "_embedding_bag_per_sample_weights_backward": lambda: (
            "aten::_embedding_bag_per_sample_weights_backward.default",
            [
                torch.ones(2, 3),
                torch.ones(4, 3),
                torch.tensor([0, BIG], dtype=long),
                torch.tensor([0, 1]),
                torch.tensor([0, BIG]),
                0,
            ],
            {},
        ),  # fmt: skip
        "_ctc_loss targets 2**40": lambda: (
            "aten::_ctc_loss.default",
            [torch.rand(5, 1, 4).log_softmax(2), torch.tensor([[1, BIG]], dtype=long), [5], [2]],
            {},
        ),
        "_pdist_backward short grad": lambda: (
            "aten::_pdist_backward.default",
            [torch.ones(1), torch.rand(64, 8), 2.0, torch.ones(2016)],
            {},
        ),
        "_cummax_helper": lambda: (
            "aten::_cummax_helper.default",
            [torch.rand(4), torch.empty(0), torch.empty(0, dtype=long), 0],
            {},
        ),
        "_native_multi_head_attention num_heads=0": lambda: (
            "aten::_native_multi_head_attention.default",
            [
                torch.rand(1, 2, 4),
                torch.rand(1, 2, 4),
                torch.rand(1, 2, 4),
                4,
                0,
                torch.rand(12, 4),
                torch.rand(12),
                torch.rand(4, 4),
                torch.rand(4),
            ],
            {},
        ),  # fmt: skip
        "_native_multi_head_attention heads not dividing": lambda: (
            "aten::_native_multi_head_attention.default",
            [
                torch.rand(1, 2, 4),
                torch.rand(1, 2, 4),
                torch.rand(1, 2, 4),
                4,
                3,
                torch.rand(12, 4),
                torch.rand(12),
                torch.rand(4, 4),
                torch.rand(4),
            ],
            {},
        ),  # fmt: skip
    }


def hostile(torch: Any) -> dict[str, Callable[[], tuple[str, list, dict]]]:
    """The issue's crashing and cross-tenant calls, by description: each makes
    ``(op name, args, kwargs)`` on plain CPU tensors; each must be refused."""
    return _hostile(torch)
