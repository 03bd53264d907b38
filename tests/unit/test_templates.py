"""Op templates on the wire: made from an op, filled back in, and validated on arrival."""

from __future__ import annotations

from array import array

import pytest

from gpu_trace.runtime.protocol.templates import (
    MAX_SESSION_NODES,
    MAX_TEMPLATE_NODES,
    MAX_TEMPLATES,
    Templates,
    TOp,
    define,
    expand,
    make_template,
    numbers,
    weight,
)
from gpu_trace.runtime.protocol.wire import ProtocolError

OPS = [
    ["aten::add.Tensor", [{"h": 7}, 1.5], {}, [8]],
    ["aten::add_.Tensor", [{"h": 7}, {"h": 9}], {"alpha": 2}, [None]],
    ["aten::cat.default", [[{"h": 3}, {"b": 4}, {"h": 5}], 0], {}, [6]],
    ["aten::sum.dim_IntList", [{"h": 3}, [1]], {"dtype": {"d": "float64"}}, [10]],
    ["aten::where.self", [{"h": 1}, {"h": 2}], {"other": {"h": 3}}, [4]],
    ["aten::split.Tensor", [{"h": 1}, 2], {}, [[11, None, 12]]],
    ["aten::_fused_op", [], {}, [13, 14]],
]


@pytest.mark.parametrize("op", OPS)
def test_a_template_filled_with_its_numbers_is_the_op(op: list) -> None:
    name, args, kwargs, outs = op
    d = make_template(5, name, args, kwargs, outs)
    templates = Templates()
    define(templates, [d])
    nums = numbers(args, kwargs, outs)
    assert len(nums) == d[5] == templates[5].holes
    assert TOp(templates[5], nums).materialize() == op
    # No handle number is left in the template itself.
    assert '"h"' not in repr(d[2:4]).replace("'", '"')


def test_the_op_stream_interleaves_template_calls_and_json_ops() -> None:
    templates = Templates()
    define(templates, [make_template(1, *OPS[0])])
    json_op = ["rt::fetch", [{"h": 8}, 99], {}, None]
    stream = array("q", [1, 7, 8, 0, 1, 8, 20]).tobytes()
    ops = expand(templates, stream, [json_op])
    assert [o if type(o) is list else o.materialize() for o in ops] == [
        OPS[0],
        json_op,
        ["aten::add.Tensor", [{"h": 8}, 1.5], {}, [20]],
    ]


@pytest.mark.parametrize(
    "defs",
    [
        "nope",
        [[1, "aten::add.Tensor", [], {}, None]],  # five fields
        [[0, "aten::add.Tensor", [], {}, None, 0]],  # id 0
        [[MAX_TEMPLATES + 1, "aten::add.Tensor", [], {}, None, 0]],
        [[1, 5, [], {}, None, 0]],  # name not a string
        [[1, "x", {}, {}, None, 0]],  # args not a list
        [[1, "x", [{"xh": 0}], {}, None, 2]],  # hole 1 missing
        [[1, "x", [{"xh": 0}, {"xh": 0}], {}, None, 2]],  # hole 0 twice
        [[1, "x", [{"xh": -1}], {}, None, 1]],
        [[1, "x", [{"xh": "0"}], {}, None, 1]],
        [[1, "x", [], {}, ["0"], 1]],  # outs are hole numbers
        [[1, "x", [], {}, [[[0]]], 1]],  # nested too deeply
        [[1, "x", [], {}, None, 10**6]],
        [[1, "x", [], {}, None, 0], [1, "y", [], {}, None, 0]],  # id defined twice
    ],
)
def test_malformed_templates_are_refused(defs: object) -> None:
    with pytest.raises(ProtocolError):
        define(Templates(), defs)


def test_a_template_id_cannot_be_redefined_later() -> None:
    templates = Templates()
    define(templates, [[1, "x", [], {}, None, 0]])
    with pytest.raises(ProtocolError):
        define(templates, [[1, "y", [], {}, None, 0]])


@pytest.mark.parametrize(
    ("stream", "json_ops"),
    [
        ([2, 1, 2], []),  # unknown template
        ([1, 7], []),  # ends inside an op (two numbers)
        ([0], []),  # names a JSON op the batch does not have
        ([1, 7, 8], [["x", [], {}, None]]),  # a JSON op left over
    ],
)
def test_malformed_op_streams_are_refused(stream: list[int], json_ops: list) -> None:
    templates = Templates()
    define(templates, [make_template(1, *OPS[0])])
    with pytest.raises(ProtocolError):
        expand(templates, array("q", stream).tobytes(), json_ops)


def test_an_op_stream_must_be_whole_int64s() -> None:
    with pytest.raises(ProtocolError):
        expand(Templates(), b"\x00" * 9, [])


def test_what_templates_hold_is_bounded_per_template_and_per_session() -> None:
    big = [1, "x", [list(range(MAX_TEMPLATE_NODES))], {}, None, 0]
    assert weight(big) > MAX_TEMPLATE_NODES
    with pytest.raises(ProtocolError):
        define(Templates(), [big])
    templates = Templates()
    each = [list(range(MAX_TEMPLATE_NODES - 16))]
    count = MAX_SESSION_NODES // weight([0, "x", each, {}, None, 0])
    define(templates, [[i + 1, "x", each, {}, None, 0] for i in range(count)])
    assert templates.nodes <= MAX_SESSION_NODES
    with pytest.raises(ProtocolError):
        define(templates, [[count + 1, "x", each, {}, None, 0]])
