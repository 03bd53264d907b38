"""JSON text fragments built from Arrow columns by vectorized string kernels.

The Chrome exporter (``chrome.py``) assembles each event line from these pieces without a Python
object per row: string literals quoted and escaped, integer nanoseconds as exact decimal
microseconds, attribute maps as ``,"key":"value"`` runs. Also here: reading Arrow columns (plain,
chunked or dictionary-encoded) as NumPy arrays and dictionary codes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

#: Characters that make a string need JSON escaping (quote, backslash, control characters).
_NEEDS_ESCAPE = r'[\x00-\x1f"\\]'
#: A value written as a JSON number: at most 18 digits and no leading zero (JSON has none), so it
#: fits an int64 in any reader; not "-0", which reads back as 0 (the text is what is kept).
_INTEGER = r"^(0|-?[1-9][0-9]{0,17})$"
#: A finite JSON number (integer or decimal, optional exponent), not a bare "-0" (as above).
_NUMBER = r"^(0|-?[1-9][0-9]*|-?(0|[1-9][0-9]*)\.[0-9]+)([eE][-+]?[0-9]+)?$"
#: A flat JSON list of integers as PyTorch's profiler writes grid and block, ``[1, 2, 3]``: a
#: reader that writes the list back as JSON gives the same text.
_LIST_ITEM = "(0|-?[1-9][0-9]{0,17})"
_INT_LIST = rf"^\[({_LIST_ITEM}(, {_LIST_ITEM})*)?\]$"


def dumps(value: Any) -> str:
    """Compact JSON for one value; non-ASCII text stays as it is."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


# ---- Arrow columns as NumPy -------------------------------------------------------------------


def combined(col: pa.Array | pa.ChunkedArray) -> pa.Array:
    """One contiguous array (chunks concatenated)."""
    return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col


def int64(col: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """An integer column as int64, nulls as 0."""
    return np.asarray(combined(col).cast(pa.int64()).fill_null(0), dtype=np.int64)


def uint64(col: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """An integer column as uint64, nulls as 0."""
    return np.asarray(combined(col).cast(pa.uint64()).fill_null(0), dtype=np.uint64)


def plain(col: pa.Array | pa.ChunkedArray) -> pa.Array:
    """A column as a plain (not dictionary-encoded) string array."""
    col = combined(col)
    if pa.types.is_dictionary(col.type):
        col = col.dictionary_decode()
    return col.cast(pa.string())


def dictionary(col: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, pa.Array]:
    """Codes (int32, no nulls) and dictionary of a string column."""
    col = combined(col)
    if not pa.types.is_dictionary(col.type):
        col = pc.dictionary_encode(col.cast(pa.string()), null_encoding="encode")
    codes = np.asarray(col.indices.cast(pa.int32()).fill_null(0), dtype=np.int32)
    values = col.dictionary.cast(pa.string())
    if values.null_count:
        values = values.fill_null("")
    if len(values) == 0:
        values = pa.array([""], pa.string())
    return codes, values


def dictionary_codes(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Codes (int64) and distinct values of an int64 array, by hashing."""
    encoded = pc.dictionary_encode(pa.array(values, pa.int64()))
    return np.asarray(encoded.indices, dtype=np.int64), np.asarray(
        encoded.dictionary, dtype=np.int64
    )


# ---- JSON fragments ---------------------------------------------------------------------------


def quote(col: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Each string as a JSON string literal (quoted and escaped); nulls become ``""``."""
    col = combined(col)
    if pa.types.is_dictionary(col.type):
        return (
            quote(col.dictionary).take(col.indices.fill_null(0))
            if len(col.dictionary)
            else pa.array(['""'] * len(col), pa.string())
        )
    col = col.cast(pa.string()).fill_null("")
    try:
        col.validate(full=True)  # invalid UTF-8 would make the whole file unreadable
        unescaped = not pc.any(pc.match_substring_regex(col, _NEEDS_ESCAPE)).as_py()
    except pa.ArrowInvalid:
        unescaped = False
    if unescaped:
        return pc.binary_join_element_wise('"', col, '"', "")
    raw = col.cast(pa.binary()).to_pylist()
    return pa.array([dumps(b.decode("utf-8", "replace")) for b in raw], pa.string())


def micros(ns: np.ndarray) -> pa.Array:
    """Integer nanoseconds as exact decimal microseconds: 1234567 -> ``1234.567``."""
    ns = np.asarray(ns, dtype=np.int64)
    neg = ns < 0
    mag = np.abs(ns)
    whole = pa.array(mag // 1000).cast(pa.string())
    frac = pc.utf8_lpad(pa.array(mag % 1000).cast(pa.string()), 3, "0")
    if neg.any():
        return pc.binary_join_element_wise(pc.if_else(pa.array(neg), "-", ""), whole, ".", frac, "")
    return pc.binary_join_element_wise(whole, ".", frac, "")


def attrs_fragment(
    col: pa.Array | pa.ChunkedArray,
    *,
    reserved: Sequence[str] = (),
    integer_keys: Sequence[str] = (),
    number_keys: Sequence[str] = (),
    list_keys: Sequence[str] = (),
) -> pa.Array | str:
    """Per row ``,"key":"value",...`` for the attributes (``""`` for none).

    A key in ``reserved`` gets ``attr.`` in front, and so, where there are reserved keys, does a
    key that starts with ``attr.`` (a reader takes exactly one ``attr.`` off again); the value
    of a key in ``integer_keys`` is written as a JSON number when it is an integer, of a key in
    ``number_keys`` when it is a number, of a key in ``list_keys`` as a JSON list when it is a
    list of integers (other values stay strings, as recorded).
    """
    col = combined(col)
    if isinstance(col, pa.MapArray):
        keys, items = col.keys, col.items
    elif pa.types.is_list(col.type) and pa.types.is_struct(col.type.value_type):
        keys, items = col.values.field(0), col.values.field(1)
    else:
        raise ValueError(f"attrs must be a map or a list of (key, value) structs, not {col.type}")
    if len(keys) == 0:
        return ""
    keys = plain(keys).fill_null("")
    if reserved:
        escaped = pc.or_(
            pc.is_in(keys, pa.array(reserved, pa.string())), pc.starts_with(keys, "attr.")
        )
        keys = pc.if_else(escaped, pc.binary_join_element_wise("attr.", keys, ""), keys)
    items = plain(items).fill_null("")
    values = quote(items)
    numeric = pc.and_(
        pc.is_in(keys, pa.array(integer_keys, pa.string())),
        pc.match_substring_regex(items, _INTEGER),
    )
    for names, pattern in ((number_keys, _NUMBER), (list_keys, _INT_LIST)):
        if names:
            numeric = pc.or_(
                numeric,
                pc.and_(
                    pc.is_in(keys, pa.array(names, pa.string())),
                    pc.match_substring_regex(items, pattern),
                ),
            )
    if pc.any(numeric).as_py():
        values = pc.if_else(numeric, items, values)
    pairs = pc.binary_join_element_wise(",", quote(keys), ":", values, "")
    offsets = col.offsets
    lists = pa.ListArray.from_arrays(offsets, pairs)
    return pc.fill_null(pc.binary_join(lists, ""), "")
