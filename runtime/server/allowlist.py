"""The ops a server runs: an allow-list of ``torch.ops.aten`` overloads.

An op travels by its schema name, ``aten::add.Tensor``. The allow-list is what real programs'
forwarding sends: the names in ``allowed_ops.txt`` next to this file (package data), made by
``scripts/make_allowlist.py`` from the ops that models built from ``torch.nn``, their losses and
optimizers, and the forwarding test programs send (and those the rules and tests name), kept where
they also pass the schema checks below. Anything else is refused by name
(:func:`refusal` says why).

The schema checks are a second guard: every argument and result of a kind the wire can carry
(tensors, numbers, booleans, strings, int/float/tensor lists, dtypes, devices, layouts, memory
formats; a generator only as ``None``), a tensor among them, not an ``out=`` form of an internal,
and not a name in :data:`DENIED` (reading files, unchecked indexing, sparse and quantized
constructors, process-wide state, internals that trust their arguments). Nothing outside ``aten``
is ever resolved.

Per-op argument rules (:data:`RULES`, and :func:`rule` per overload) pin arguments that would
switch off bounds checks, and check the views, indices and enum arguments ATen itself does not
(:mod:`gpu_trace.runtime.server.bounds`).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: The allow-list's names, one ``aten::name.overload`` a line (scripts/make_allowlist.py).
ALLOWED_OPS_FILE = Path(__file__).with_name("allowed_ops.txt")

_ARG_TYPES = frozenset(
    {
        "Tensor",
        "int",
        "bool",
        "float",
        "str",
        "number",
        "complex",
        "Device",
        "List[int]",
        "List[Tensor]",
        "List[bool]",
        "List[float]",
        "List[number]",
        "List[str]",
        "List[complex]",
        "List[Optional[Tensor]]",
        "Optional[int]",
        "Optional[Tensor]",
        "Optional[float]",
        "Optional[bool]",
        "Optional[Device]",
        "Optional[List[int]]",
        "Optional[Generator]",
        "Optional[str]",
        "Optional[number]",
        "Optional[List[float]]",
        "Optional[List[Optional[Tensor]]]",
    }
)
_RETURN_TYPES = frozenset(
    {"Tensor", "List[Tensor]", "int", "float", "bool", "number", "complex", "str"}
)

#: Names (before the overload) never resolved, whatever their schema.
DENIED = re.compile(
    r"^aten::("
    r"from_file|_unsafe_index.*|_unsafe_masked_index.*|.*sparse.*|.*quantiz.*|.*mkldnn.*"
    r"|.*_nested.*|nested_.*|_pin_memory|pin_memory|is_pinned|record_stream|_print"
    r"|.*_cache.*|_test_.*|_foobar|_fused_moving_avg_obs_fq_helper.*|.*fake_quant.*"
    r"|_set_.*|set_|.*cudnn.*|.*miopen.*|_cufft.*|.*_mps.*|_async_error|_nnz|_indices|_values"
    # Internals that trust their arguments (found by tests/op_fuzz.py: they crash the server or
    # reach outside their storages on arguments their public ops would have refused). Clients
    # send the public ops (``__torch_dispatch__`` sees those, not what a kernel calls inside).
    r"|_add_batch_dim|_remove_batch_dim|_nnpack_.*|_slow_conv2d_.*|_stack"
    r"|_transform_bias_rescale_qkv|fractional_max_pool[23]d_backward|_cholesky_solve_helper"
    r"|_convert_indices_from_.*|_new_zeros_with_same_feature_meta|_sobol_engine_.*|_chunk_cat"
    r"|_dyn_quant_.*|_weight_int[48]pack_mm.*|_convert_weight_to_int4pack.*"
    r"|fbgemm_.*|_saturate_weight_to_fp16|_thnn_differentiable_.*|_masked_softmax.*"
    r")$"
)
#: Overloads never resolved: TorchScript's ``to`` variants (``to.prim_Device(t, None, None,
#: False, True)`` is a SIGSEGV); clients send ``to.dtype``, ``to.device`` or ``_to_copy``.
DENIED_OVERLOADS = re.compile(r"^aten::to\.prim_.*$")


def _pin_false(name: str, position: int) -> Callable[[list[Any], dict[str, Any]], None]:
    def rule(args: list[Any], kwargs: dict[str, Any]) -> None:
        if name in kwargs:
            kwargs[name] = False
        elif len(args) > position:
            args[position] = False

    return rule


#: Argument rules applied before an op runs, by op name (every overload): ``rule(args, kwargs)``
#: may change them in place, or refuse the op (an ``OpError``).
RULES: dict[str, Callable[[list[Any], dict[str, Any]], None]] = {
    "aten::_index_put_impl_": _pin_false("unsafe", 4),
}


def rule(op: Any) -> Callable[[list[Any], dict[str, Any]], None] | None:
    """The rule an ``OpOverload`` runs under (None: none): its name's from :data:`RULES`, its
    overload's bounds checks (:func:`gpu_trace.runtime.server.bounds.rules_for`) and the checks
    of the kernels that trust their indices and shapes
    (:data:`gpu_trace.runtime.server.kernel_checks.BY_NAME`), in that order."""
    from gpu_trace.runtime.server import bounds, kernel_checks

    schema = op._schema
    rules = [r for r in (RULES.get(schema.name),) if r is not None]
    rules += bounds.rules_for(schema)
    rules += [r for r in (kernel_checks.BY_NAME.get(schema.name),) if r is not None]
    if not rules:
        return None
    if len(rules) == 1:
        return rules[0]

    def combined(args: list[Any], kwargs: dict[str, Any]) -> None:
        for r in rules:
            r(args, kwargs)

    return combined


_lock = threading.Lock()
_admissible: frozenset[str] | None = None
_allowed: frozenset[str] | None = None
_resolved: dict[str, Any] = {}


def _record_to_file() -> Callable[[str], None] | None:
    """``GPU_TRACE_RECORD_OPS``'s recorder (None where it is unset): each name once per
    process, appended as a line (one ``write`` to an ``O_APPEND`` file: servers and their
    workers share it). The file is opened here, at import, before a worker is contained (after,
    it may open no file)."""
    from gpu_trace import config

    path = config.record_ops()
    if path is None:
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError:
        return None
    seen: set[str] = set()

    def record(name: str) -> None:
        if name in seen:
            return
        seen.add(name)
        with contextlib.suppress(OSError):  # recording must never fail an op
            os.write(fd, (name + "\n").encode())

    return record


#: Told every ``aten::`` name a client asks for, before the allow-list is consulted (refused
#: names too): the seam through which scripts/make_allowlist.py collects what programs send.
#: ``GPU_TRACE_RECORD_OPS`` sets one that appends to a file; None records nothing.
recorder: Callable[[str], None] | None = _record_to_file()


def admissible() -> frozenset[str]:
    """Every ``aten::name.overload`` (``.default`` for the unnamed overload) that passes the
    schema checks and :data:`DENIED` (see the module docstring): what the allow-list may hold."""
    global _admissible
    if _admissible is None:
        import torch

        names = set()
        for schema in torch._C._jit_get_all_schemas():
            if not schema.name.startswith("aten::") or DENIED.match(schema.name):
                continue
            if not all(str(a.type) in _ARG_TYPES for a in schema.arguments):
                continue
            if not all(str(r.type) in _RETURN_TYPES for r in schema.returns):
                continue
            if schema.name.startswith("aten::_") and any(a.is_out for a in schema.arguments):
                # ``out=`` forms of internals: clients never send them (an ``out=`` call of a
                # public op is that op's own ``.out``), and they check their outputs least
                # (_batch_norm_no_update.out, _pdist_backward.out, _fft_r2c.out: SIGSEGV).
                continue
            if not any("Tensor" in str(v.type) for v in (*schema.arguments, *schema.returns)):
                # TorchScript's builtins on numbers, strings and lists, and its global switches
                # (manual_seed, set_grad_enabled): no client sends them (it forwards tensor
                # ops), and integer division by zero in them kills the process (SIGFPE).
                continue
            name = f"{schema.name}.{schema.overload_name or 'default'}"
            if not DENIED_OVERLOADS.match(name):
                names.add(name)
        with _lock:
            _admissible = frozenset(names)
    return _admissible


def listed() -> frozenset[str]:
    """The names in :data:`ALLOWED_OPS_FILE` (blank lines and ``#`` comments skipped)."""
    lines = ALLOWED_OPS_FILE.read_text().splitlines()
    return frozenset(n.strip() for n in lines if n.strip() and not n.startswith("#"))


def allowed() -> frozenset[str]:
    """Every allowed ``aten::name.overload``: the listed names that are :func:`admissible`."""
    global _allowed
    if _allowed is None:
        names = listed() & admissible()
        with _lock:
            _allowed = names
    return _allowed


def refusal(name: object) -> str:
    """Why ``name`` is not resolved: the op error a client gets."""
    if type(name) is not str:
        return "an op name must be a string"
    shown = name[:200]
    if not shown.startswith("aten::"):
        return f"{shown!r} is not on this server's allow-list: only aten ops are resolved"
    if name in allowed():
        return f"{shown} could not be resolved in this server's torch"
    if name in admissible():
        why = (
            "forwarded programs do not send it (the list is what models, losses and "
            "optimizers send; scripts/make_allowlist.py)"
        )
    elif DENIED.match(name.partition(".")[0]) or DENIED_OVERLOADS.match(name):
        why = "it is denied (file access, unchecked indexing, sparse/quantized, internals)"
    else:
        why = "no such overload, or its arguments cannot travel or it is an internal's out= form"
    return f"{shown} is not on this server's allow-list: {why}"


def resolve(name: object) -> Any:
    """The ``OpOverload`` for an allowed name; ``None`` for anything else."""
    if recorder is not None and type(name) is str and name.startswith("aten::"):
        recorder(name[:200])
    op = _resolved.get(name)  # type: ignore[call-overload]
    if op is not None:
        return op
    if type(name) is not str or name not in allowed():
        return None
    import torch

    base, _, overload = name[len("aten::") :].partition(".")
    try:
        op = getattr(getattr(torch.ops.aten, base), overload)
    except (AttributeError, RuntimeError):
        return None
    with _lock:
        _resolved[name] = op
    return op
