"""The backend settings that change an op's numerics, as one value both sides speak.

A program's ``torch.backends.cuda.matmul.allow_tf32``, ``torch.backends.cudnn.allow_tf32`` /
``benchmark`` / ``deterministic`` / ``enabled``, ``torch.set_float32_matmul_precision``, the
``fp32_precision`` settings, the cuBLAS reduced-precision reductions and
``torch.use_deterministic_algorithms`` are process-wide state in PyTorch's ``at::Context``. In
transparent mode they are set in the client's process, but its ops run in the server's: the
client sends a :func:`read` of them (``rt::flags``) where the program changes one, and the server
:func:`apply`\\ s a session's settings while it runs that session's ops (and puts back its own for
the next session that has none: one tenant's TF32 never reaches another's matmuls).

The ``fp32_precision`` table and the legacy switches (matmul precision, cuDNN's TF32) are two
views of one state in torch 2.9+; :func:`apply` sets the legacy ones first, then each table entry
that still differs, so that entries the legacy switches derive stay derived.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

#: The settings as JSON: strings, booleans and pairs of booleans, by the names in :data:`KEYS`.
Flags = dict[str, Any]

#: The ``fp32_precision`` table's entries (``at::Context::fp32_precision``), broad ones first.
FP32_KEYS = (
    ("generic", "all"),
    ("mkldnn", "all"),
    ("cuda", "all"),
    ("mkldnn", "conv"),
    ("mkldnn", "rnn"),
    ("mkldnn", "matmul"),
    ("cuda", "conv"),
    ("cuda", "rnn"),
    ("cuda", "matmul"),
)
PRECISIONS = frozenset({"none", "ieee", "tf32", "bf16", "default"})
MATMUL_PRECISIONS = frozenset({"highest", "high", "medium"})
BOOLS = (
    "cudnn_enabled",
    "cudnn_benchmark",
    "cudnn_deterministic",
    "cudnn_allow_tf32",
    "deterministic",
    "deterministic_warn_only",
    "fill_uninitialized_memory",
)
PAIRS = ("fp16_reduction", "bf16_reduction")  # (allow reduced precision, allow split-K)
KEYS = frozenset({"matmul_precision", *BOOLS, *PAIRS, *(f"fp32:{b}:{o}" for b, o in FP32_KEYS)})


#: Plain settings: name -> (getter, setter) in ``torch._C``.
_PLAIN = {
    "cudnn_enabled": ("_get_cudnn_enabled", "_set_cudnn_enabled"),
    "cudnn_benchmark": ("_get_cudnn_benchmark", "_set_cudnn_benchmark"),
    "cudnn_deterministic": ("_get_cudnn_deterministic", "_set_cudnn_deterministic"),
    "fill_uninitialized_memory": (
        "_get_deterministic_fill_uninitialized_memory",
        "_set_deterministic_fill_uninitialized_memory",
    ),
    "fp16_reduction": (
        "_get_cublas_allow_fp16_reduced_precision_reduction",
        "_set_cublas_allow_fp16_reduced_precision_reduction",
    ),
    "bf16_reduction": (
        "_get_cublas_allow_bf16_reduced_precision_reduction",
        "_set_cublas_allow_bf16_reduced_precision_reduction",
    ),
}


def read(torch: ModuleType, legacy: dict[str, str | bool] | None = None) -> Flags:
    """This process's settings, as plain JSON values (those this torch has).

    The legacy switches cannot be read once a program has mixed the legacy and the new APIs
    (PyTorch raises); ``legacy`` gives them where the caller has followed their setters (the
    client does), else they are taken from the table."""
    c = torch._C
    flags: Flags = {}
    if hasattr(c, "_get_fp32_precision_getter"):
        for b, o in FP32_KEYS:
            flags[f"fp32:{b}:{o}"] = str(c._get_fp32_precision_getter(b, o))
    known = legacy or {}
    matmul = known.get("matmul_precision")
    if matmul is None:
        try:
            matmul = str(c._get_float32_matmul_precision())
        except RuntimeError:
            matmul = "high" if flags.get("fp32:cuda:matmul") == "tf32" else "highest"
    cudnn_tf32 = known.get("cudnn_allow_tf32")
    if cudnn_tf32 is None:
        try:
            cudnn_tf32 = bool(c._get_cudnn_allow_tf32())
        except RuntimeError:
            cudnn_tf32 = flags.get("fp32:cuda:conv") == "tf32"
    flags["matmul_precision"] = matmul
    flags["cudnn_allow_tf32"] = cudnn_tf32
    flags["deterministic"] = bool(c._get_deterministic_algorithms())
    flags["deterministic_warn_only"] = bool(c._get_deterministic_algorithms_warn_only())
    for name, (getter, _) in _PLAIN.items():
        if hasattr(c, getter):
            value = getattr(c, getter)()
            if name in PAIRS:  # (allow, allow split-K) in torch 2.10+, one boolean before
                value = (
                    [bool(v) for v in value] if isinstance(value, tuple) else [bool(value), True]
                )
            flags[name] = value if name in PAIRS else bool(value)
    return flags


def check(value: object) -> Flags:
    """``value`` from the wire as settings (any of :data:`KEYS`: a peer's torch may lack some),
    or ValueError saying what is wrong with it."""
    if type(value) is not dict or not set(value) <= KEYS:
        raise ValueError(f"backend settings are an object with keys among {sorted(KEYS)}")
    if value.get("matmul_precision", "highest") not in MATMUL_PRECISIONS:
        raise ValueError(f"matmul_precision is one of {sorted(MATMUL_PRECISIONS)}")
    for name in BOOLS:
        if name in value and type(value[name]) is not bool:
            raise ValueError(f"{name} is a boolean")
    for name in PAIRS:
        pair = value.get(name, [True, True])
        if type(pair) is not list or len(pair) != 2 or any(type(v) is not bool for v in pair):
            raise ValueError(f"{name} is two booleans")
    for b, o in FP32_KEYS:
        if value.get(f"fp32:{b}:{o}", "none") not in PRECISIONS:
            raise ValueError(f"fp32:{b}:{o} is one of {sorted(PRECISIONS)}")
    return value


def apply(torch: ModuleType, flags: Flags) -> None:
    """Make ``flags`` (checked) this process's settings, those this torch has."""
    c = torch._C
    if "matmul_precision" in flags:
        c._set_float32_matmul_precision(flags["matmul_precision"])
    if "cudnn_allow_tf32" in flags:
        c._set_cudnn_allow_tf32(flags["cudnn_allow_tf32"])
    if hasattr(c, "_set_fp32_precision_setter"):
        for b, o in FP32_KEYS:
            wanted = flags.get(f"fp32:{b}:{o}")
            if wanted is not None and c._get_fp32_precision_getter(b, o) != wanted:
                c._set_fp32_precision_setter(b, o, wanted)
    if "deterministic" in flags:
        c._set_deterministic_algorithms(
            flags["deterministic"], warn_only=flags.get("deterministic_warn_only", False)
        )
    for name, (_, setter) in _PLAIN.items():
        if name in flags and hasattr(c, setter):
            if name in PAIRS:
                try:
                    getattr(c, setter)(*flags[name])
                except TypeError:  # one boolean before torch 2.10
                    getattr(c, setter)(flags[name][0])
            else:
                getattr(c, setter)(flags[name])
