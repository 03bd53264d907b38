"""Op arguments and tensors on the wire: encoding (client) and validated decoding (server).

An argument is JSON: ``null``, booleans, integers (int64), floats (``NaN``/``Infinity`` allowed),
strings, lists, and one-key objects for everything else:

====================  ============================================================
``{"h": 7}``          the session's tensor handle 7
``{"b": 3}``          blob 3 of the session (tensor bytes sent in or before the batch)
``{"d": "float32"}``  a dtype, by name (:data:`DTYPES`)
``{"v": "r"}``        a device: ``"r"`` the server's device, ``"cpu"``
``{"l": "strided"}``  a layout; ``{"m": "channels_last"}`` a memory format
``{"c": [re, im]}``   a complex number
====================  ============================================================

Tensors cross as raw little-endian bytes in C order with a dtype name and a shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from gpu_trace.runtime.protocol.wire import (
    INT64_MAX,
    INT64_MIN,
    MAX_DEPTH,
    MAX_LIST,
    MAX_STRING,
    MAX_TENSOR_BYTES,
    ProtocolError,
)

MAX_DIMS = 16
MAX_DIM = 1 << 40

_DTYPE_NAMES = (
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "bool",
    "complex64",
    "complex128",
    "uint16",
    "uint32",
    "uint64",
)
_LAYOUTS = ("strided",)
_MEMORY_FORMATS = ("contiguous_format", "channels_last", "channels_last_3d", "preserve_format")

_torch: Any = None
#: name -> torch.dtype and back; filled on first use (torch loads lazily).
DTYPES: dict[str, Any] = {}
DTYPE_NAMES: dict[Any, str] = {}
_ITEMSIZE: dict[str, int] = {}
_FORMATS: dict[str, Any] = {}
_FORMAT_NAMES: dict[Any, str] = {}


def _load() -> Any:
    global _torch
    if _torch is None:
        import torch

        for name in _DTYPE_NAMES:
            dt = getattr(torch, name, None)
            if isinstance(dt, torch.dtype):
                DTYPES[name] = dt
                DTYPE_NAMES[dt] = name
                _ITEMSIZE[name] = dt.itemsize
        for name in _MEMORY_FORMATS:
            _FORMATS[name] = getattr(torch, name)
            _FORMAT_NAMES[getattr(torch, name)] = name
        _torch = torch
    return _torch


# ---- tensor headers ------------------------------------------------------------------------------


def tensor_meta(dtype: Any, shape: Any, nbytes: Any) -> tuple[Any, list[int], int]:
    """Validated ``(torch dtype, shape, nbytes)`` of a tensor on the wire."""
    _load()
    if type(dtype) is not str or dtype not in DTYPES:
        raise ProtocolError(f"unknown dtype {str(dtype)[:40]!r}")
    if type(shape) is not list or len(shape) > MAX_DIMS:
        raise ProtocolError(f"shape must be a list of at most {MAX_DIMS} sizes")
    numel = 1
    for d in shape:
        if type(d) is not int or not 0 <= d <= MAX_DIM:
            raise ProtocolError("shape sizes must be non-negative integers")
        numel *= d
    if type(nbytes) is not int or nbytes != numel * _ITEMSIZE[dtype]:
        raise ProtocolError("tensor byte count does not match its dtype and shape")
    if nbytes > MAX_TENSOR_BYTES:
        raise ProtocolError(f"tensor of {nbytes} bytes exceeds the limit of {MAX_TENSOR_BYTES}")
    return DTYPES[dtype], shape, nbytes


def tensor_bytes(t: Any) -> memoryview:
    """A CPU tensor's bytes in C order (no copy when it is already contiguous)."""
    torch = _load()
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    flat = t.reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def tensor_from_bytes(dtype: Any, shape: list[int], data: bytes | bytearray | memoryview) -> Any:
    """A new CPU tensor holding a copy of ``data``."""
    torch = _load()
    out = torch.empty(len(data), dtype=torch.uint8)
    if len(data):
        out.numpy()[:] = memoryview(data).cast("B")
    return out.view(dtype).reshape(shape)


def empty_buffer(nbytes: int) -> Any:
    """A uint8 CPU tensor to assemble chunks into."""
    return _load().empty(nbytes, dtype=_torch.uint8)


# ---- client: encode ------------------------------------------------------------------------------


def encode_dtype(dt: Any) -> dict[str, str]:
    _load()
    try:
        return {"d": DTYPE_NAMES[dt]}
    except KeyError:
        raise TypeError(f"dtype {dt} cannot be forwarded") from None


def encode_scalar_like(value: Any) -> Any:
    """Encode a non-tensor argument value; ``TypeError`` for what cannot travel."""
    torch = _load()
    if value is None or isinstance(value, (bool, int, str)):
        if (
            isinstance(value, int)
            and not isinstance(value, bool)
            and not (INT64_MIN <= value <= INT64_MAX)
        ):
            raise TypeError(f"integer {value} does not fit in int64")
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, torch.dtype):
        return encode_dtype(value)
    if isinstance(value, torch.device):
        return {"v": "cpu" if value.type == "cpu" else "r"}
    if isinstance(value, torch.layout):
        if value != torch.strided:
            raise TypeError(f"layout {value} cannot be forwarded")
        return {"l": "strided"}
    if isinstance(value, torch.memory_format):
        return {"m": _FORMAT_NAMES[value]}
    if isinstance(value, complex):
        return {"c": [value.real, value.imag]}
    raise TypeError(f"an argument of type {type(value).__name__} cannot be forwarded")


# ---- server: decode and validate -----------------------------------------------------------------


class ArgDecoder:
    """Turns wire arguments into Python/torch values for one session.

    ``handle(n)`` and ``blob(n)`` look up the session's own tables (a handle of another session is
    simply unknown); ``device`` is the server's device.
    """

    def __init__(
        self, handle: Callable[[int], Any], blob: Callable[[int], Any], device: Any
    ) -> None:
        self.handle = handle
        self.blob = blob
        self.device = device
        self.cpu = _cpu()

    def decode(self, value: Any, depth: int = 0) -> Any:
        t = type(value)
        if t is int:
            if not INT64_MIN <= value <= INT64_MAX:
                raise ProtocolError("integer argument out of int64 range")
            return value
        if t is float or t is bool or value is None:
            return value
        if t is str:
            if len(value) > MAX_STRING:
                raise ProtocolError("string argument too long")
            return value
        if t is list:
            if depth >= MAX_DEPTH:
                raise ProtocolError("argument nested too deeply")
            if len(value) > MAX_LIST:
                raise ProtocolError("list argument too long")
            return [self.decode(v, depth + 1) for v in value]
        if t is dict:
            if len(value) != 1:
                raise ProtocolError("tagged argument must have exactly one key")
            ((tag, inner),) = value.items()
            if tag == "h":
                return self.handle(_ident(inner))
            if tag == "b":
                return self.blob(_ident(inner))
            if tag == "d":
                if type(inner) is not str or inner not in DTYPES:
                    raise ProtocolError(f"unknown dtype {str(inner)[:40]!r}")
                return DTYPES[inner]
            if tag == "v":
                if inner == "r":
                    return self.device
                if inner == "cpu":
                    return self.cpu
                raise ProtocolError("unknown device")
            if tag == "l":
                if inner not in _LAYOUTS:
                    raise ProtocolError("unknown layout")
                return _torch.strided
            if tag == "m":
                if type(inner) is not str or inner not in _FORMATS:
                    raise ProtocolError("unknown memory format")
                return _FORMATS[inner]
            if tag == "c":
                if (
                    type(inner) is not list
                    or len(inner) != 2
                    or not all(type(x) in (int, float) for x in inner)
                ):
                    raise ProtocolError("complex must be [re, im]")
                return complex(inner[0], inner[1])
            raise ProtocolError(f"unknown argument tag {str(tag)[:20]!r}")
        raise ProtocolError(f"argument of JSON type {t.__name__} not allowed")

    def decode_args(self, args: list[Any]) -> list[Any]:
        """A top-level argument list (fast path for handles and plain scalars)."""
        if len(args) > MAX_LIST:
            raise ProtocolError("too many arguments")
        out = []
        for v in args:
            t = type(v)
            if t is dict and len(v) == 1 and "h" in v:
                out.append(self.handle(_ident(v["h"])))
            elif t is float or t is bool or v is None:
                out.append(v)
            else:
                out.append(self.decode(v, 1))
        return out

    def decode_kwargs(self, value: Any) -> dict[str, Any]:
        if type(value) is not dict or len(value) > 64:
            raise ProtocolError("keyword arguments must be an object of at most 64 entries")
        out = {}
        for k, v in value.items():
            if not k.isidentifier() or len(k) > 64:
                raise ProtocolError("keyword argument names must be identifiers")
            out[k] = self.decode(v)
        return out


_CPU: list[Any] = []


def _cpu() -> Any:
    """``torch.device("cpu")``, made once."""
    if not _CPU:
        _CPU.append(_load().device("cpu"))
    return _CPU[0]


def _ident(value: Any) -> int:
    if type(value) is not int or not 0 < value <= INT64_MAX:
        raise ProtocolError("handle and blob ids are positive integers")
    return value


# ---- results (server -> client) ------------------------------------------------------------------


def encode_result(value: Any) -> Any:
    """A scalar result of a synchronous op (``item()``, ``is_nonzero``...) as JSON."""
    torch = _load()
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"f": repr(value)}
    if isinstance(value, complex):
        return {"c": [value.real, value.imag]}
    if isinstance(value, torch.dtype):
        return encode_dtype(value)
    if isinstance(value, (list, tuple)):
        return [encode_result(v) for v in value]
    raise TypeError(f"result of type {type(value).__name__} cannot be returned")


def decode_result(value: Any) -> Any:
    if isinstance(value, list):
        return [decode_result(v) for v in value]
    if isinstance(value, dict) and len(value) == 1:
        ((tag, inner),) = value.items()
        if tag == "f" and inner in ("nan", "inf", "-inf"):
            return float(inner)
        if tag == "c":
            return complex(inner[0], inner[1])
        if tag == "d":
            _load()
            return DTYPES[inner]
    return value
