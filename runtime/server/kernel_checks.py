"""Checks of the arguments kernels trust: indices, and one tensor's shape taken for another's.

Many ATen kernels, backwards most of all, never check what their callers (autograd, the public
op) always pass right: a max pool's backward adds each gradient at its index, a convolution's
walks ``grad_output`` as the forward's result, the native attention divides by its heads. A
tenant can send them anything, so each is checked here before it runs: index values in range,
shapes as the forward would make them (worked out on meta tensors where it is simplest), sizes
and counts within bounds. Found by the op fuzzer's structured cases (``tests/op_cases.py``:
the programs' own calls with one value made hostile); docs/remote.md ("Security") lists them.
The rules are by op name (:data:`BY_NAME`, every overload), run by
:func:`gpu_trace.runtime.server.allowlist.rule` after :mod:`~gpu_trace.runtime.server.bounds`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpu_trace.runtime.protocol.errors import OpError
from gpu_trace.runtime.server.bounds import Rule, _arg, _ints

if TYPE_CHECKING:
    import torch


def _long_indices(op: str, name: str, indices: object) -> bool:
    """Whether ``indices`` is a tensor (False: not one, the op refuses it); refuses any but int64
    (the kernels read them as int64)."""
    if not hasattr(indices, "dtype"):
        return False
    if str(indices.dtype) != "torch.int64":
        raise OpError(f"{op}: {name} must be int64, not {str(indices.dtype)[6:]}")
    return True


def _in_range(op: str, name: str, indices: torch.Tensor, lo: int, hi: int, what: str) -> None:
    """Refuse values of ``indices`` outside ``[lo, hi)`` (one pass over them)."""
    if indices.numel() == 0:
        return
    least, most = indices.aminmax()
    low, high = int(least), int(most)
    if low < lo or high >= hi:
        raise OpError(f"{op}: {name} from {low} to {high} out of range for {what}")


def _pool_backward_rule(op: str, dims: int, at: int) -> Rule:
    """``max_pool{2,3}d_with_indices_backward`` and ``adaptive_max_pool{2,3}d_backward`` (what
    autograd of the max pools sends): the CPU kernel adds each gradient element to the input's
    plane at its index unchecked (an index of 2**40 was a SIGSEGV; a smaller one wrote into
    another tenant's tensor), over the input's batch and channels. So: ``indices`` int64 and
    shaped as ``grad_output``, whose leading (batch, channel) sizes are the input's, and every
    index within the input's plane (its last ``dims`` sizes)."""

    def rule(args: list[object], kwargs: dict[str, object]) -> None:
        grad = _arg(args, kwargs, 0, "grad_output")
        t = _arg(args, kwargs, 1, "self")
        indices = _arg(args, kwargs, at, "indices")
        if not _long_indices(op, "indices", indices):
            return
        if not (hasattr(grad, "shape") and hasattr(t, "shape")):
            return  # not tensors: the op refuses them
        if t.dim() not in (dims + 1, dims + 2) or grad.dim() != t.dim():
            raise OpError(
                f"{op}: self and grad_output must both have {dims + 1} or {dims + 2} dims"
            )
        if tuple(grad.shape[:-dims]) != tuple(t.shape[:-dims]):
            raise OpError(f"{op}: grad_output's batch and channels must be self's")
        if tuple(indices.shape) != tuple(grad.shape):
            raise OpError(f"{op}: indices must have grad_output's shape {list(grad.shape)}")
        plane = 1
        for n in t.shape[-dims:]:
            plane *= n
        _in_range(op, "indices", indices, 0, plane, f"an input plane of {plane} elements")

    return rule


def _layer_norm_backward_rule(op: str) -> Rule:
    """``native_layer_norm_backward`` (what autograd of ``layer_norm`` sends): ATen checks
    ``normalized_shape`` against the input and weight, not the rest; the CPU kernel walks
    ``grad_out`` as the input and ``mean``/``rstd`` as one number per normalized row (an empty
    ``grad_out`` was a SIGSEGV)."""

    def rule(args: list[object], kwargs: dict[str, object]) -> None:
        grad, x = _arg(args, kwargs, 0, "grad_out"), _arg(args, kwargs, 1, "input")
        shape = _ints(op, "normalized_shape", _arg(args, kwargs, 2, "normalized_shape"))
        mean, rstd = _arg(args, kwargs, 3, "mean"), _arg(args, kwargs, 4, "rstd")
        if not all(hasattr(t, "shape") for t in (grad, x, mean, rstd)):
            return  # not tensors: the op refuses them
        k = len(shape)
        if k == 0 or x.dim() < k or list(x.shape[x.dim() - k :]) != shape:
            raise OpError(f"{op}: normalized_shape {shape} must end the input's shape")
        if tuple(grad.shape) != tuple(x.shape):
            raise OpError(f"{op}: grad_out must have the input's shape {list(x.shape)}")
        rows = 1
        for n in x.shape[: x.dim() - k]:
            rows *= n
        for name, t in (("mean", mean), ("rstd", rstd)):
            if t.numel() != rows:
                raise OpError(f"{op}: {name} must have {rows} elements (one per row)")
        size = 1
        for n in shape:
            size *= n
        for position, name in ((5, "weight"), (6, "bias")):
            t = _arg(args, kwargs, position, name)
            if hasattr(t, "numel") and t.numel() != size:
                raise OpError(f"{op}: {name} must have {size} elements")

    return rule


def _shape_of(t: object) -> list[int] | None:
    return list(t.shape) if hasattr(t, "shape") else None


def _meta_shape(
    op: str, forward: Callable[..., torch.Tensor], tensors: list[torch.Tensor], rest: list[object]
) -> list[int]:
    """The shape of ``forward(*tensors, *rest)`` worked out on meta tensors (a forward that
    refuses these arguments refuses its backward too)."""
    import torch

    metas = [
        torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") for t in tensors
    ]
    try:
        return list(forward(*metas, *rest).shape)
    except Exception as exc:  # the forward's own refusal
        raise OpError(f"{op}: {exc}") from None


def _forward_shape_rule(op: str, forward: str, grad: str, base: str, params: int) -> Rule:
    """Backwards whose CPU kernels walk ``grad_output`` as the forward's result, unchecked:
    ``avg_pool{2,3}d_backward`` (an empty gradient was a SIGSEGV). ``grad_output`` must have the
    shape ``forward(self, *the next params arguments)`` has, worked out on meta tensors."""

    def rule(args: list[object], kwargs: dict[str, object]) -> None:
        import torch

        g, t = _arg(args, kwargs, 0, grad), _arg(args, kwargs, 1, base)
        if not (hasattr(g, "shape") and hasattr(t, "shape")):
            return  # not tensors: the op refuses them
        rest = list(args[2 : 2 + params])
        if len(rest) < params:
            return  # keyword arguments: the op itself refuses what it lacks
        want = _meta_shape(op, getattr(torch.ops.aten, forward).default, [t], rest)
        if list(g.shape) != want:
            raise OpError(f"{op}: {grad} must be of shape {want} (the forward's result)")

    return rule


def _convolution_backward_rule(op: str) -> Rule:
    """``convolution_backward`` (what autograd of every convolution sends): the CPU kernels walk
    ``grad_output`` as the convolution's result unchecked (an empty one was a SIGSEGV). It must
    have the shape ``convolution`` gives the input and weight with these parameters (on meta
    tensors)."""

    def rule(args: list[object], kwargs: dict[str, object]) -> None:
        import torch

        g, x, w = (
            _arg(args, kwargs, i, n) for i, n in enumerate(("grad_output", "input", "weight"))
        )
        if not all(hasattr(t, "shape") for t in (g, x, w)) or len(args) < 10:
            return  # not tensors, or keywords: the op refuses what it lacks
        stride, padding, dilation, transposed, output_padding, groups = args[4:10]
        forward = torch.ops.aten.convolution.default
        rest = [None, stride, padding, dilation, transposed, output_padding, groups]
        want = _meta_shape(op, forward, [x, w], rest)
        if list(g.shape) != want:
            raise OpError(f"{op}: grad_output must be of shape {want} (the convolution's result)")

    return rule


def _adaptive_avg_backward_rule(op: str, dims: int) -> Rule:
    """``_adaptive_avg_pool{2,3}d_backward``: the CPU kernel walks the input's batch and
    channels in ``grad_output`` (one row short corrupted the heap)."""

    def rule(args: list[object], kwargs: dict[str, object]) -> None:
        g, t = _arg(args, kwargs, 0, "grad_output"), _arg(args, kwargs, 1, "self")
        if not (hasattr(g, "shape") and hasattr(t, "shape")):
            return  # not tensors: the op refuses them
        if t.dim() not in (dims + 1, dims + 2) or g.dim() != t.dim():
            raise OpError(
                f"{op}: self and grad_output must both have {dims + 1} or {dims + 2} dims"
            )
        if tuple(g.shape[:-dims]) != tuple(t.shape[:-dims]):
            raise OpError(f"{op}: grad_output's batch and channels must be self's")

    return rule


def _same_shape_rule(op: str, names: tuple[tuple[int, str], ...]) -> Rule:
    """Backwards whose CPU kernels walk one tensor as another's shape, unchecked:
    ``_softmax_backward_data`` and ``_log_softmax_backward_data`` read ``output`` as
    ``grad_output`` (an empty ``output`` was read past its storage)."""

    def rule(args: list[object], kwargs: dict[str, object]) -> None:
        shapes = [(n, _shape_of(_arg(args, kwargs, i, n))) for i, n in names]
        first = shapes[0][1]
        for name, shape in shapes[1:]:
            if first is not None and shape is not None and shape != first:
                raise OpError(f"{op}: {name} must have {shapes[0][0]}'s shape {first}")

    return rule


def _floating_rule(op: str, names: tuple[tuple[int, str], ...]) -> Rule:
    """``smooth_l1_loss_backward``: its CPU kernel for an integer ``self`` divides by ``beta``
    cast to an integer (0 for any beta under 1: a SIGFPE). Its tensors must be floating-point
    (or complex), as the loss's are."""

    def rule(args: list[object], kwargs: dict[str, object]) -> None:
        for position, name in names:
            t = _arg(args, kwargs, position, name)
            if hasattr(t, "is_floating_point") and not (t.is_floating_point() or t.is_complex()):
                raise OpError(f"{op}: {name} must be a floating-point tensor, not {t.dtype}")

    return rule


def _cdist_backward_rule(op: str) -> Rule:
    """``_cdist_backward`` (what autograd of ``torch.cdist`` sends): the CPU kernel walks
    ``grad`` and ``cdist`` as ``x1``'s rows by ``x2``'s (an empty grad was a SIGSEGV)."""

    def rule(args: list[object], kwargs: dict[str, object]) -> None:
        g, x1, x2 = (_arg(args, kwargs, i, n) for i, n in enumerate(("grad", "x1", "x2")))
        d = _arg(args, kwargs, 4, "cdist")
        if not all(hasattr(t, "shape") for t in (g, x1, x2, d)):
            return  # not tensors: the op refuses them
        if x1.dim() < 2 or x2.dim() != x1.dim() or x1.shape[-1] != x2.shape[-1]:
            raise OpError(f"{op}: x1 and x2 must be batches of rows of one length")
        if tuple(x1.shape[:-2]) != tuple(x2.shape[:-2]):
            raise OpError(f"{op}: x1 and x2 must have the same batch shape")
        want = [*x1.shape[:-2], x1.shape[-2], x2.shape[-2]]
        for name, t in (("grad", g), ("cdist", d)):
            if list(t.shape) != want:
                raise OpError(f"{op}: {name} must be of shape {want}")

    return rule


def _norms_shape(op: str, v: torch.Tensor, dim: object) -> list[int]:
    """The shape of weight norm's ``g`` and norms: ``v``'s size at ``dim`` (0 or the last),
    ones elsewhere; ``-1``: one element."""
    if type(dim) is not int:
        raise OpError(f"{op}: dim must be an integer")
    if dim == -1:
        return [1] * v.dim()
    if dim not in (0, v.dim() - 1):
        raise OpError(f"{op}: dim must be 0, the last or -1 (got {dim})")
    return [n if i == dim else 1 for i, n in enumerate(v.shape)]


def _weight_norm_interface_rule(op: str, backward: bool) -> Rule:
    """``_weight_norm_interface`` and its backward (what ``weight_norm`` sends): the CPU kernels
    read ``g`` and the saved norms as one number per slice along ``dim`` (an empty ``g`` was a
    SIGSEGV) and ``grad_w`` as ``v``; an empty ``v`` divides by zero (SIGFPE)."""
    vs = ("saved_v", 1) if backward else ("v", 0)

    def rule(args: list[object], kwargs: dict[str, object]) -> None:
        v = _arg(args, kwargs, vs[1], vs[0])
        if not hasattr(v, "numel"):
            return  # not a tensor: the op refuses it
        if v.numel() == 0 or v.dim() == 0:
            raise OpError(f"{op}: {vs[0]} must have at least one dimension and one element")
        dim = _arg(args, kwargs, 4 if backward else 2, "dim")
        want = _norms_shape(op, v, 0 if dim is None else dim)
        named = [("saved_g", 2), ("saved_norms", 3)] if backward else [("g", 1)]
        for name, position in named:
            t = _arg(args, kwargs, position, name)
            if hasattr(t, "shape") and list(t.shape) != want:
                raise OpError(f"{op}: {name} must be of shape {want}")
        if backward:
            g = _arg(args, kwargs, 0, "grad_w")
            if hasattr(g, "shape") and tuple(g.shape) != tuple(v.shape):
                raise OpError(f"{op}: grad_w must have saved_v's shape {list(v.shape)}")

    return rule


#: Largest kernel, dilation, padding and stride of ``im2col``/``col2im`` (each one a loop's
#: bound: a padding of 2**40 held the executor).
MAX_WINDOW = 1 << 16


def _col2im_rule(op: str, col2im: bool) -> Rule:
    """``im2col`` and ``col2im`` (``nn.Unfold``, ``nn.Fold``): kernel, dilation and stride in
    ``[1, MAX_WINDOW]``, padding in ``[0, MAX_WINDOW]`` (a padding of 2**40 made ``col2im`` loop
    for ever); ``col2im``'s input must hold as many blocks as these give (exact integers)."""
    names = ("kernel_size", "dilation", "padding", "stride")

    def rule(args: list[object], kwargs: dict[str, object]) -> None:
        first = 2 if col2im else 1
        values = {}
        for i, name in enumerate(names):
            v = _ints(op, name, _arg(args, kwargs, first + i, name))
            if len(v) != 2:
                raise OpError(f"{op}: {name} must be two integers")
            lo = 0 if name == "padding" else 1
            if not all(lo <= x <= MAX_WINDOW for x in v):
                raise OpError(f"{op}: {name} {v} out of [{lo}, {MAX_WINDOW}]")
            values[name] = v
        if not col2im:
            return
        t = _arg(args, kwargs, 0, "self")
        out = _ints(op, "output_size", _arg(args, kwargs, 1, "output_size"))
        if len(out) != 2 or not hasattr(t, "shape"):
            return  # the op refuses it
        blocks = 1
        for i in range(2):
            k, d, p, s = (values[n][i] for n in names)
            n = (out[i] + 2 * p - (d * (k - 1) + 1)) // s + 1
            if n < 1:
                raise OpError(f"{op}: output_size {out} leaves no sliding block")
            blocks *= n
        if t.dim() not in (2, 3) or t.shape[-1] != blocks:
            raise OpError(f"{op}: the input must hold {blocks} blocks in its last dimension")
        if t.shape[-2] % (values["kernel_size"][0] * values["kernel_size"][1]):
            raise OpError(f"{op}: the input's channels must be a multiple of the kernel's size")

    return rule


def _attention_rule(op: str, positions: dict[str, int], query: str) -> Rule:
    """``_native_multi_head_attention`` and ``_transformer_encoder_layer_fwd`` (what
    ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` send in eval mode without grad):
    the CPU kernels divide by ``num_heads`` (0 was a SIGFPE), walk the projections as
    ``embed_dim`` wide and hand ``mask_type`` to the masked softmax, which indexes by it
    unchecked. So: heads > 0 dividing ``embed_dim``, the query ``(batch, length, embed_dim)``,
    the projections' shapes, ``mask_type`` 0 (a ``(length, length)`` mask), 1 (``(batch,
    length)``), 2 (``(batch, heads, length, length)``) with a mask of that shape, or no
    mask."""

    def get(args: list[object], kwargs: dict[str, object], name: str) -> Any:
        return _arg(args, kwargs, positions[name], name)

    def rule(args: list[object], kwargs: dict[str, object]) -> None:
        e = get(args, kwargs, "embed_dim")
        heads = get(args, kwargs, "num_heads" if "num_heads" in positions else "num_head")
        if type(e) is not int or type(heads) is not int or e < 1 or heads < 1 or e % heads:
            raise OpError(f"{op}: num_heads ({heads}) must be positive and divide embed_dim ({e})")
        q = get(args, kwargs, query)
        if not hasattr(q, "shape"):
            return  # not a tensor: the op refuses it
        if q.dim() != 3 or q.shape[-1] != e:
            raise OpError(f"{op}: {query} must be (batch, length, {e})")
        b, length = q.shape[0], q.shape[1]
        source = length
        for name in ("key", "value"):
            if name in positions:
                t = get(args, kwargs, name)
                if hasattr(t, "shape") and (t.dim() != 3 or t.shape[0] != b or t.shape[-1] != e):
                    raise OpError(f"{op}: {name} must be ({b}, length, {e})")
                source = t.shape[1] if hasattr(t, "shape") else source
        want = {
            "qkv_weight": [3 * e, e],
            "qkv_bias": [3 * e],
            "proj_weight": [e, e],
            "proj_bias": [e],
        }
        for name, shape in want.items():
            t = get(args, kwargs, name)
            if hasattr(t, "shape") and list(t.shape) != shape:
                raise OpError(f"{op}: {name} must be of shape {shape}")
        mask, kind = get(args, kwargs, "mask"), get(args, kwargs, "mask_type")
        if kind not in (None, 0, 1, 2) or type(kind) is bool:
            raise OpError(f"{op}: mask_type must be 0, 1, 2 or None, not {kind!r}")
        if mask is None:
            return
        if kind is None:
            raise OpError(f"{op}: a mask needs its mask_type")
        shape = ([length, source], [b, source], [b, heads, length, source])[kind]
        if not hasattr(mask, "shape") or list(mask.shape) != shape:
            raise OpError(f"{op}: a mask of mask_type {kind} must be of shape {shape}")

    return rule


#: Checks by op name (every overload).
BY_NAME: dict[str, Rule] = {
    "aten::_weight_norm_interface": _weight_norm_interface_rule("_weight_norm_interface", False),
    "aten::_weight_norm_interface_backward": _weight_norm_interface_rule(
        "_weight_norm_interface_backward", True
    ),
    "aten::convolution_backward": _convolution_backward_rule("convolution_backward"),
    "aten::_cdist_backward": _cdist_backward_rule("_cdist_backward"),
    "aten::smooth_l1_loss_backward": _floating_rule(
        "smooth_l1_loss_backward", ((0, "grad_output"), (1, "self"), (2, "target"))
    ),
    **{
        f"aten::{name}": _same_shape_rule(name, ((0, "grad_output"), (1, "output")))
        for name in ("_softmax_backward_data", "_log_softmax_backward_data")
    },
    "aten::avg_pool2d_backward": _forward_shape_rule(
        "avg_pool2d_backward", "avg_pool2d", "grad_output", "self", 6
    ),
    "aten::avg_pool3d_backward": _forward_shape_rule(
        "avg_pool3d_backward", "avg_pool3d", "grad_output", "self", 6
    ),
    "aten::_adaptive_avg_pool2d_backward": _adaptive_avg_backward_rule(
        "_adaptive_avg_pool2d_backward", 2
    ),
    "aten::_adaptive_avg_pool3d_backward": _adaptive_avg_backward_rule(
        "_adaptive_avg_pool3d_backward", 3
    ),
    "aten::im2col": _col2im_rule("im2col", False),
    "aten::col2im": _col2im_rule("col2im", True),
    "aten::_native_multi_head_attention": _attention_rule(
        "_native_multi_head_attention",
        {
            "query": 0,
            "key": 1,
            "value": 2,
            "embed_dim": 3,
            "num_head": 4,
            "qkv_weight": 5,
            "qkv_bias": 6,
            "proj_weight": 7,
            "proj_bias": 8,
            "mask": 9,
            "mask_type": 12,
        },
        "query",
    ),  # fmt: skip
    "aten::_transformer_encoder_layer_fwd": _attention_rule(
        "_transformer_encoder_layer_fwd",
        {
            "src": 0,
            "embed_dim": 1,
            "num_heads": 2,
            "qkv_weight": 3,
            "qkv_bias": 4,
            "proj_weight": 5,
            "proj_bias": 6,
            "mask": 18,
            "mask_type": 19,
        },
        "src",
    ),  # fmt: skip
    "aten::native_layer_norm_backward": _layer_norm_backward_rule("native_layer_norm_backward"),
    "aten::max_pool2d_with_indices_backward": _pool_backward_rule(
        "max_pool2d_with_indices_backward", 2, 7
    ),
    "aten::max_pool3d_with_indices_backward": _pool_backward_rule(
        "max_pool3d_with_indices_backward", 3, 7
    ),
    "aten::adaptive_max_pool2d_backward": _pool_backward_rule("adaptive_max_pool2d_backward", 2, 2),
    "aten::adaptive_max_pool3d_backward": _pool_backward_rule("adaptive_max_pool3d_backward", 3, 2),
}
