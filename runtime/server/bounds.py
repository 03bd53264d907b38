"""Bounds checks run before an allow-listed op: no tenant's op may reach outside its own storages.

The server runs tenants' ATen ops in one process, so a view past the end of a storage reads or
writes whatever the allocator put next: another tenant's tensors, or the heap's own bookkeeping.
ATen checks most ops itself; the ones it does not are checked here, before they run (a check
afterwards would be too late for an op that copies through the view it makes). Each check is a
``rule(args, kwargs)`` in :data:`gpu_trace.runtime.server.allowlist.RULES` (by op name) or made per
overload by :func:`rules_for`; a refusal is an :class:`~gpu_trace.runtime.protocol.errors.OpError`
naming the op and why, and the session goes on. The checks of the kernels that trust their
indices and shapes (the pool and convolution backwards...) are in
:mod:`gpu_trace.runtime.server.kernel_checks`.

Which ops need which check was found from the schemas and is held by a fuzzer that throws random
sizes, strides, offsets, dims and indices at every allow-listed op (``tests/op_fuzz.py``);
docs/remote.md ("Security") lists the families and what happens to each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpu_trace.runtime.protocol.errors import OpError

Rule = Callable[[list[Any], dict[str, Any]], None]

#: Enum arguments: a client sends them tagged (``{"d": "float32"}``), decoded to torch objects.
#: A bare integer would be taken as the enum's number unchecked: ScalarType 18-45 are bit and
#: float8 types, and numbers past the table's end index static tables out of bounds.
_ENUM_TYPES = ("ScalarType", "Layout", "MemoryFormat")


def _arg(args: list[Any], kwargs: dict[str, Any], position: int, name: str) -> Any:
    if len(args) > position:
        return args[position]
    return kwargs.get(name)


def _ints(op: str, what: str, value: Any) -> list[int]:
    if type(value) is list:
        for v in value:
            if type(v) is not int:
                break
        else:
            return value
    raise OpError(f"{op}: {what} must be a list of integers")


def check_view(op: str, base: Any, size: Any, stride: Any, offset: Any) -> None:
    """Refuse a view of ``base``'s storage with ``size``, ``stride`` and element ``offset``
    (None: ``base``'s own) unless every element lies inside the storage. Python integers:
    products that would overflow int64 cannot wrap round to a small extent."""
    size = _ints(op, "size", size)
    stride = _ints(op, "stride", stride)
    if len(size) != len(stride):
        raise OpError(f"{op}: size {size} and stride {stride} differ in length")
    if not hasattr(base, "untyped_storage"):
        return  # not a tensor: the op itself refuses it
    if offset is None:
        offset = base.storage_offset()
    elif type(offset) is not int:
        raise OpError(f"{op}: the storage offset must be an integer")
    last = offset
    empty = False
    for n, s in zip(size, stride):
        if n < 0 or s < 0:
            raise OpError(f"{op}: negative size, stride or offset ({size}, {stride}, {offset})")
        if n == 0:
            empty = True
        last += (n - 1) * s
    if offset < 0:
        raise OpError(f"{op}: negative size, stride or offset ({size}, {stride}, {offset})")
    if empty:
        return  # no element: nothing is reached
    need = (last + 1) * base.element_size()
    have = base.untyped_storage().nbytes()
    if need > have:
        raise OpError(
            f"{op}: a view of size {size}, stride {stride} and offset {offset} needs "
            f"{need} bytes of a {have}-byte storage (out of bounds)"
        )


def _view_rule(op: str, base: int, size: int, stride: int, offset: int | None) -> Rule:
    """A rule checking the view an op makes from its arguments at these positions (names from
    the schema: ``self``, ``size``, ``stride``, ``storage_offset``)."""

    def rule(args: list[Any], kwargs: dict[str, Any]) -> None:
        t = _arg(args, kwargs, base, "self")
        off = None if offset is None else _arg(args, kwargs, offset, "storage_offset")
        check_view(
            op, t, _arg(args, kwargs, size, "size"), _arg(args, kwargs, stride, "stride"), off
        )

    return rule


def check_dims(op: str, t: Any, dims: Any, lowest: int = 0) -> None:
    """Refuse a dimension list that is empty, repeats a dimension or names one ``t`` lacks
    (from ``lowest``: ``-t.dim()`` where negative dims count from the end)."""
    dims = _ints(op, "dim", dims)
    ndim = t.dim() if hasattr(t, "dim") else 0
    if not dims or any(not lowest <= d < ndim for d in dims):
        raise OpError(f"{op}: dims {dims} out of range for a {ndim}-dimensional tensor")
    if len({d % ndim for d in dims}) != len(dims):
        raise OpError(f"{op}: dims {dims} repeat a dimension")


def _fft_rule(op: str) -> Rule:
    """``_fft_r2c``/``_fft_c2r``/``_fft_c2c`` (what ``torch.fft`` calls, with dims already
    wrapped): ATen indexes the input's sizes by ``dim`` unchecked (a dim of -2**31-1 crashed
    the server; dim 3 of a 1-d tensor read a size from past the end; -1 is not wrapped);
    ``c2r``'s output size must be positive."""

    def rule(args: list[Any], kwargs: dict[str, Any]) -> None:
        t = _arg(args, kwargs, 0, "self")
        check_dims(op, t, _arg(args, kwargs, 1, "dim"))
        if type(_arg(args, kwargs, 2, "normalization")) is not int:
            raise OpError(f"{op}: normalization must be an integer")
        if op.startswith("_fft_c2r"):
            size = _arg(args, kwargs, 3, "last_dim_size")
            if type(size) is not int or size < 1:
                raise OpError(f"{op}: last_dim_size must be a positive integer")

    return rule


def _pad_backward_rule(op: str, n: int) -> Rule:
    """``reflection_pad{n}d_backward`` and ``replication_pad{n}d_backward`` (what autograd of
    the pads sends): ATen reads ``2n`` paddings and the input's last ``n + 1`` sizes unchecked
    (a 0-d input with no padding was a SIGSEGV)."""

    def rule(args: list[Any], kwargs: dict[str, Any]) -> None:
        grad = _arg(args, kwargs, 0, "grad_output")
        t = _arg(args, kwargs, 1, "self")
        padding = _ints(op, "padding", _arg(args, kwargs, 2, "padding"))
        if len(padding) != 2 * n:
            raise OpError(f"{op}: padding needs {2 * n} integers, got {len(padding)}")
        for name, v in (("self", t), ("grad_output", grad)):
            if hasattr(v, "dim") and v.dim() not in (n + 1, n + 2):
                raise OpError(f"{op}: {name} must have {n + 1} or {n + 2} dimensions")
        if not (hasattr(t, "shape") and hasattr(grad, "shape")):
            return  # not tensors: the op refuses them
        # The kernel walks grad_output as self's shape padded (one row short was read past).
        want = list(t.shape)
        for i in range(n):
            want[-1 - i] += padding[2 * i] + padding[2 * i + 1]
        if list(grad.shape) != want:
            raise OpError(f"{op}: grad_output must be of shape {want} (self's, padded)")

    return rule


def _weight_norm_rule(op: str, position: int, name: str) -> Rule:
    """``_weight_norm``, ``_weight_norm_interface`` (what ``weight_norm`` sends) and its
    backward: an empty weight divides by zero inside the CPU kernel (SIGFPE)."""

    def rule(args: list[Any], kwargs: dict[str, Any]) -> None:
        v = _arg(args, kwargs, position, name)
        if hasattr(v, "numel") and (v.numel() == 0 or v.dim() == 0):
            raise OpError(f"{op}: {name} must have at least one dimension and one element")

    return rule


def check_indices(op: str, indices: Any, size: Any) -> None:
    """Refuse index values outside ``[0, size)``: one pass over ``indices`` (on CUDA, a wait
    for the device)."""
    if type(size) is not int:
        raise OpError(f"{op}: num_weights must be an integer")
    if not hasattr(indices, "numel") or indices.numel() == 0:
        return
    if indices.is_floating_point() or indices.is_complex() or indices.dtype.is_signed is None:
        return  # not an index tensor: the op refuses it
    lo, hi = indices.aminmax()
    lo, hi = int(lo), int(hi)
    if lo < 0 or hi >= size:
        raise OpError(f"{op}: indices from {lo} to {hi} out of range for {size} rows")


def _embedding_backward_rule(op: str) -> Rule:
    """``embedding_dense_backward`` (what autograd of ``embedding`` sends) and
    ``embedding_backward``: the CPU kernel writes the gradient's rows at ``indices`` unchecked
    (an index of 2**40 was a SIGSEGV, -5 wrote before the result's storage, silently)."""

    def rule(args: list[Any], kwargs: dict[str, Any]) -> None:
        indices = _arg(args, kwargs, 1, "indices")
        check_indices(op, indices, _arg(args, kwargs, 2, "num_weights"))

    return rule


def _lists_rule(op: str, lists: tuple[tuple[int, str], ...]) -> Rule:
    """``_foreach_*``: every tensor and number list as long as the first (``_foreach_copy``
    with an empty and a one-tensor list was a SIGSEGV)."""

    def rule(args: list[Any], kwargs: dict[str, Any]) -> None:
        n = len(args)
        lengths = []
        for position, name in lists:
            value = args[position] if n > position else kwargs.get(name)
            if type(value) is list:
                lengths.append(len(value))
        if len(set(lengths)) > 1:
            raise OpError(f"{op}: its lists differ in length ({lengths})")

    return rule


def _fused_optimizer_rule(op: str, lists: tuple[tuple[int, str], ...]) -> Rule:
    """``_fused_adam_`` and the other fused optimizers (what ``fused=True`` sends): the CPU
    kernels walk every list's tensor ``i`` as ``params[i].numel()`` contiguous elements (a
    2-element grad for a 1000-element param was a SIGSEGV). So: lists as long as the params'
    (or empty), each tensor contiguous and as large as its param; ``state_steps`` one element
    each."""

    def rule(args: list[Any], kwargs: dict[str, Any]) -> None:
        n = len(args)
        params = None
        for position, name in lists:
            value = args[position] if n > position else kwargs.get(name)
            if type(value) is not list:
                continue
            if params is None:
                params = value
            elif value and len(value) != len(params):
                raise OpError(f"{op}: {name} has {len(value)} tensors for {len(params)} params")
            for i, t in enumerate(value):
                if not hasattr(t, "numel"):
                    continue  # not a tensor: the op refuses it
                if name == "state_steps":
                    if t.numel() != 1:
                        raise OpError(f"{op}: state_steps[{i}] must have one element")
                elif not t.is_contiguous() or t.numel() != params[i].numel():
                    raise OpError(
                        f"{op}: {name}[{i}] must be contiguous with {params[i].numel()} "
                        "elements, like its param"
                    )

    return rule


#: One-element tensors of the mixed-precision ops (GradScaler's ``_amp_*`` and the fused
#: optimizers' ``grad_scale``/``found_inf`` and tensor ``lr``), by argument name, with their
#: dtype (None: any).
_ONE_ELEMENT: dict[str, str | None] = {
    "lr": None,
    "grad_scale": "torch.float32",
    "found_inf": "torch.float32",
    "inv_scale": "torch.float32",
    "growth_tracker": "torch.int32",
}


def _one_element_rule(op: str, at: tuple[tuple[int, str, str | None], ...]) -> Rule:
    """``grad_scale``/``found_inf``/``lr`` of the fused optimizers, the scale, ``found_inf``,
    ``inv_scale`` and ``growth_tracker`` of ``_amp_update_scale_`` and
    ``_amp_foreach_non_finite_check_and_unscale_``: kernels read or write them as one number.
    The fused optimizers' CPU kernels do not check (an empty ``grad_scale`` was read past its
    storage: NaN params), the ``_amp`` ones do; all are checked here, before any device runs."""

    def rule(args: list[object], kwargs: dict[str, object]) -> None:
        for position, name, dtype in at:
            t = _arg(args, kwargs, position, name)
            if not hasattr(t, "numel"):
                continue  # absent (optional), or not a tensor: the op refuses it
            if t.numel() != 1:
                raise OpError(f"{op}: {name} must have one element, not {t.numel()}")
            if dtype is not None and str(t.dtype) != dtype:
                raise OpError(f"{op}: {name} must be {dtype[6:]}, not {str(t.dtype)[6:]}")

    return rule


_PER_CHANNEL = ("weight", "bias", "running_mean", "running_var", "save_mean", "save_invstd")


def _batch_norm_rule(op: str, at: dict[str, int], backward: bool, eval_only: bool) -> Rule:
    """Batch norms (``native_batch_norm`` and kin, and their backwards): the CPU kernels take
    every per-channel tensor as ``input.size(1)`` elements and, when not training, the running
    statistics as given (eval mode with none was a SIGSEGV; a backward of an empty input a
    SIGFPE; ``_native_batch_norm_legit.no_stats`` told not to train a SIGSEGV). ``save_*``
    may be empty (what eval mode's forward returns)."""

    def get(args: list[Any], kwargs: dict[str, Any], name: str) -> Any:
        position = at.get(name)
        if position is None:
            return None
        return args[position] if len(args) > position else kwargs.get(name)

    def rule(args: list[Any], kwargs: dict[str, Any]) -> None:
        x = get(args, kwargs, "input")
        if not hasattr(x, "dim"):
            return  # not a tensor: the op refuses it
        if x.dim() < 2:
            raise OpError(f"{op}: input must have at least 2 dimensions")
        if backward and x.numel() == 0:
            raise OpError(f"{op}: input has no elements")
        channels = x.shape[1]
        for name in _PER_CHANNEL:
            t = get(args, kwargs, name)
            n = t.numel() if hasattr(t, "numel") else channels
            if n != channels and not (name.startswith("save_") and n == 0):
                raise OpError(f"{op}: {name} must have {channels} elements (input channels)")
        grad = get(args, kwargs, "grad_out")
        if backward and hasattr(grad, "shape") and tuple(grad.shape) != tuple(x.shape):
            # Walked as the input's shape: an empty grad_out was a SIGSEGV.
            raise OpError(f"{op}: grad_out must have the input's shape {list(x.shape)}")
        training = get(args, kwargs, "training" if "training" in at else "train")
        if eval_only:
            training = False
        if backward and training is True:
            for name in ("save_mean", "save_invstd"):
                t = get(args, kwargs, name)
                if hasattr(t, "numel") and t.numel() != channels:
                    # Read per channel when training (an empty save_mean was a SIGSEGV).
                    raise OpError(f"{op}: {name} must have {channels} elements when training")
        stats = (get(args, kwargs, "running_mean"), get(args, kwargs, "running_var"))
        if training is False and any(s is None for s in stats):
            raise OpError(f"{op}: running_mean and running_var are needed when not training")

    return rule


def _gqa_rule(op: str) -> Rule:
    """``_scaled_dot_product_attention_math`` with ``enable_gqa`` divides the query's heads by
    the key's and value's unchecked (none: a SIGFPE)."""

    def rule(args: list[Any], kwargs: dict[str, Any]) -> None:
        if kwargs.get("enable_gqa") is not True:
            return
        q, k, v = (_arg(args, kwargs, i, n) for i, n in enumerate(("query", "key", "value")))
        if not all(hasattr(t, "dim") for t in (q, k, v)):
            return  # not tensors: the op refuses them
        if min(q.dim(), k.dim(), v.dim()) < 3:
            raise OpError(f"{op}: query, key and value need at least 3 dimensions")
        heads = q.shape[-3]
        for name, t in (("key", k), ("value", v)):
            if t.shape[-3] == 0 or heads % t.shape[-3]:
                raise OpError(f"{op}: {name} heads ({t.shape[-3]}) must divide query heads")

    return rule


def _dense_rule(op: str, positional: tuple[tuple[int, str], ...]) -> Rule:
    """``sparse``/``sparse_grad`` flags (embedding, embedding_bag, gather and their
    backwards): True makes a sparse tensor, which the server keeps out (no bounds checks on
    its indices; the wire cannot carry it)."""

    def rule(args: list[Any], kwargs: dict[str, Any]) -> None:
        n = len(args)
        for position, name in positional:
            value = args[position] if n > position else kwargs.get(name)
            if value is True:
                raise OpError(f"{op}: {name}=True (sparse results) is not supported")

    return rule


def _enum_rule(op: str, positional: tuple[tuple[int, str], ...], names: tuple[str, ...]) -> Rule:
    def rule(args: list[Any], kwargs: dict[str, Any]) -> None:
        if kwargs:
            for name in names:
                if type(kwargs.get(name)) is int:
                    _bare(op, name, kwargs[name])
        n = len(args)
        for position, name in positional:
            if n > position and type(args[position]) is int:
                _bare(op, name, args[position])

    return rule


#: Highest degree of the orthogonal polynomials (``special_*_polynomial_*``): their CPU and CUDA
#: kernels loop ``n`` times per element, so a huge ``n`` held the executor (every tenant's work)
#: for minutes. Degrees past this have no use in floating point.
MAX_POLYNOMIAL_DEGREE = 4096


def _degree_rule(op: str) -> Rule:
    """``n`` of ``special_*_polynomial_*`` (a tensor or a number) within
    :data:`MAX_POLYNOMIAL_DEGREE` and finite (one pass over a tensor ``n``)."""

    def rule(args: list[Any], kwargs: dict[str, Any]) -> None:
        n = _arg(args, kwargs, 1, "n")
        if hasattr(n, "numel"):
            if n.numel() == 0 or n.is_complex():
                return  # nothing to loop over; complex: the op refuses it
            top = n.detach().abs().amax().item()
        else:
            try:
                top = abs(n)
            except TypeError:
                return  # not a number: the op refuses it
        if not top <= MAX_POLYNOMIAL_DEGREE:  # NaN too
            raise OpError(
                f"{op}: degree n up to {top} is past the server's limit of "
                f"{MAX_POLYNOMIAL_DEGREE} (the kernel loops n times per element)"
            )

    return rule


def _bare(op: str, name: str, value: int) -> None:
    raise OpError(f"{op}: {name} must be sent as a {name} (a tagged value), not the number {value}")


#: Checks by op name (every overload: ``.default`` and ``.out`` share their leading arguments);
#: views first, then the ops that take dims ATen does not check.
BY_NAME: dict[str, Rule] = {
    # No check in ATen: a view of any size and stride over the input's storage.
    "aten::_reshape_alias": _view_rule("_reshape_alias", 0, 1, 2, None),
    "aten::_reshape_alias_copy": _view_rule("_reshape_alias_copy", 0, 1, 2, None),
    # ATen checks these (checkInBoundsForStorage); checked here too, in exact integers.
    "aten::as_strided": _view_rule("as_strided", 0, 1, 2, 3),
    "aten::as_strided_": _view_rule("as_strided_", 0, 1, 2, 3),
    "aten::as_strided_copy": _view_rule("as_strided_copy", 0, 1, 2, 3),
    "aten::_fft_r2c": _fft_rule("_fft_r2c"),
    "aten::_fft_c2r": _fft_rule("_fft_c2r"),
    "aten::_fft_c2c": _fft_rule("_fft_c2c"),
    "aten::_weight_norm": _weight_norm_rule("_weight_norm", 0, "v"),
    "aten::embedding_dense_backward": _embedding_backward_rule("embedding_dense_backward"),
    "aten::_scaled_dot_product_attention_math": _gqa_rule("_scaled_dot_product_attention_math"),
    "aten::embedding_backward": _embedding_backward_rule("embedding_backward"),
    **{
        f"aten::special_{family}_polynomial_{kind}": _degree_rule(
            f"special_{family}_polynomial_{kind}"
        )
        for family, kinds in (
            ("chebyshev", "tuvw"),
            ("shifted_chebyshev", "tuvw"),
            ("hermite", ("h", "he")),
            ("laguerre", "l"),
            ("legendre", "p"),
        )
        for kind in kinds
    },
    **{
        f"aten::{kind}_pad{n}d_backward": _pad_backward_rule(f"{kind}_pad{n}d_backward", n)
        for kind in ("reflection", "replication")
        for n in (1, 2, 3)
    },
}


def rules_for(schema: Any) -> list[Rule]:
    """The checks one overload needs beyond its name's (:data:`BY_NAME`)."""
    op = f"{schema.name[len('aten::') :]}.{schema.overload_name or 'default'}"
    positional, names, flags = [], [], []
    for i, a in enumerate(schema.arguments):
        if a.name in ("sparse", "sparse_grad") and str(a.type) == "bool":
            flags.append((i, a.name))
        ty = str(a.real_type)
        if ty.startswith("Optional["):
            ty = ty[len("Optional[") : -1]
        if ty in _ENUM_TYPES:
            names.append(a.name)
            if not a.kwarg_only:
                positional.append((i, a.name))
    lists = tuple(
        (i, a.name)
        for i, a in enumerate(schema.arguments)
        if str(a.type) in ("List[Tensor]", "List[number]", "List[float]", "List[complex]")
    )
    rules = []
    at = {a.name: i for i, a in enumerate(schema.arguments)}
    if "batch_norm" in schema.name and "input" in at:
        eval_only = "no_update" in schema.name or "no_training" in schema.name
        rules.append(_batch_norm_rule(op, at, "backward" in schema.name, eval_only))
    if schema.name.startswith("aten::_foreach_") and len(lists) > 1:
        rules.append(_lists_rule(op, lists))
    if schema.name.startswith("aten::_fused_") and len(lists) > 1:
        rules.append(_fused_optimizer_rule(op, lists))
    if schema.name.startswith(("aten::_fused_", "aten::_amp_")):
        scalars = tuple(
            (i, a.name, _ONE_ELEMENT.get(a.name, "torch.float32"))
            for i, a in enumerate(schema.arguments)
            if str(a.type) in ("Tensor", "Optional[Tensor]")
            and (a.name in _ONE_ELEMENT or schema.name.startswith("aten::_amp_update_scale"))
        )
        if scalars:
            rules.append(_one_element_rule(op, scalars))
    if flags:
        rules.append(_dense_rule(op, tuple(flags)))
    if names:
        rules.append(_enum_rule(op, tuple(positional), tuple(names)))
    view = BY_NAME.get(schema.name)
    if view is not None:
        rules.append(view)
    return rules
