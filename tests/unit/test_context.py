"""W3C trace context: extraction, injection, the child environment and malformed input."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gpu_trace.tracer import context
from gpu_trace.tracer.context import (
    TraceParent,
    child_env,
    extract,
    extract_tracestate,
    format_traceparent,
    inject,
    new_trace_id,
    parse_traceparent,
    trace_id_from_env,
)

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = 0x00F067AA0BA902B7
GOOD = f"00-{TRACE}-00f067aa0ba902b7-01"

MALFORMED = [
    "",
    "garbage",
    "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",  # trace id one digit short
    "00-4bf92f3577b34da6a3ce929d0e0e47366-00f067aa0ba902b7-01",  # one digit long
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b-01",  # span id short
    "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",  # upper-case hex
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00F067AA0BA902B7-01",
    "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # version ff is invalid
    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # all-zero trace id
    "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # all-zero span id
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",  # version 00 has 4 fields
    "0-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    "00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01",
    "zz-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g",
    GOOD + "-" + "x" * 600,
    "\x00\xff",
]


def test_roundtrip_through_headers() -> None:
    carrier: dict[str, str] = {}
    inject(carrier, TRACE, SPAN)
    assert carrier == {"traceparent": GOOD}
    assert extract(carrier) == TraceParent(TRACE, SPAN)
    trace_id, parent = extract(carrier)  # type: ignore[misc]
    assert (trace_id, parent) == (TRACE, SPAN)


def test_roundtrip_through_an_environment() -> None:
    env: dict[str, str] = {}
    inject(env, TRACE, SPAN, sampled=False, env=True)
    assert env == {"TRACEPARENT": f"00-{TRACE}-00f067aa0ba902b7-00"}
    assert extract(env) == (TRACE, SPAN)


def test_fresh_ids_roundtrip() -> None:
    for _ in range(50):
        trace_id = new_trace_id()
        carrier: dict[str, str] = {}
        inject(carrier, trace_id, (1 << 64) - 1)
        assert extract(carrier) == (trace_id, (1 << 64) - 1)


def test_header_names_are_case_insensitive_on_extract() -> None:
    assert extract({"Traceparent": GOOD}) == (TRACE, SPAN)
    assert extract({"TRACEPARENT": GOOD}) == (TRACE, SPAN)


def test_multiple_header_values_use_the_first() -> None:
    assert extract({"traceparent": [GOOD, f"00-{'1' * 32}-{'2' * 16}-01"]}) == (TRACE, SPAN)


@pytest.mark.parametrize("value", MALFORMED)
def test_malformed_values_are_ignored(value: str) -> None:
    assert extract({"traceparent": value}) is None
    assert extract({"TRACEPARENT": value, "TRACESTATE": "a=b"}) is None
    assert extract_tracestate({"traceparent": value, "tracestate": "a=b"}) == ""
    assert parse_traceparent(value) is None


@pytest.mark.parametrize(
    "carrier",
    [
        None,
        {},
        {"traceparent": None},
        {"traceparent": 17},
        {"traceparent": [1, 2]},
        {"other": GOOD},
    ],
)
def test_missing_or_odd_carriers_are_ignored(carrier: object) -> None:
    assert extract(carrier) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "value",
    [
        *MALFORMED,
        GOOD,
        f"  {GOOD}  ",
        f"\t{GOOD}",
        f"01-{TRACE}-00f067aa0ba902b7-01-future-fields",  # later versions may add fields
        f"cc-{TRACE}-00f067aa0ba902b7-00",
    ],
)
def test_the_fast_parser_agrees_with_the_propagator(value: str) -> None:
    ctx = TraceContextTextMapPropagator().extract({"traceparent": value})
    sc = trace.get_current_span(ctx).get_span_context()
    expected = (f"{sc.trace_id:032x}", f"{sc.span_id:016x}") if sc.is_valid else None
    assert parse_traceparent(value) == expected


def test_tracestate_passes_through() -> None:
    carrier: dict[str, str] = {}
    inject(carrier, TRACE, SPAN, tracestate="vendor=abc,other=1")
    assert carrier["tracestate"] == "vendor=abc,other=1"
    assert extract_tracestate(carrier) == "vendor=abc,other=1"
    env: dict[str, str] = {}
    inject(env, TRACE, SPAN, tracestate="vendor=abc", env=True)
    assert env["TRACESTATE"] == "vendor=abc"


def test_invalid_tracestate_is_dropped_not_raised() -> None:
    assert extract({"traceparent": GOOD, "tracestate": "not a valid=state=,,"}) == (TRACE, SPAN)
    assert extract_tracestate({"traceparent": GOOD, "tracestate": "@@@"}) == ""


@pytest.mark.parametrize(
    ("trace_id", "span_id"),
    [
        ("", SPAN),
        ("0" * 32, SPAN),
        ("xyz" * 11 + "x", SPAN),
        (TRACE, 0),
        (TRACE, 1 << 64),
        (TRACE, -1),
    ],
)
def test_inject_rejects_invalid_ids(trace_id: str, span_id: int) -> None:
    with pytest.raises(ValueError):
        inject({}, trace_id, span_id)


def test_child_env_carries_the_run_trace() -> None:
    env = {"PATH": "/usr/bin", "HOME": "/root"}
    out = child_env(env, TRACE, SPAN)
    assert out == {"PATH": "/usr/bin", "HOME": "/root", "TRACEPARENT": GOOD}
    assert env == {"PATH": "/usr/bin", "HOME": "/root"}  # not modified


def test_child_env_replaces_an_incoming_parent_and_keeps_its_tracestate() -> None:
    env = {"TRACEPARENT": f"00-{TRACE}-{'1' * 16}-01", "TRACESTATE": "vendor=abc"}
    out = child_env(env, TRACE, SPAN)
    assert out == {"TRACEPARENT": GOOD, "TRACESTATE": "vendor=abc"}


def test_child_env_drops_the_tracestate_of_another_trace() -> None:
    env = {
        "TRACEPARENT": f"00-{'1' * 32}-{'1' * 16}-01",
        "TRACESTATE": "vendor=abc",
        "traceparent": "x",
    }
    out = child_env(env, TRACE, SPAN)
    assert out == {"TRACEPARENT": GOOD}


def test_trace_id_from_env_honours_an_incoming_traceparent(monkeypatch: pytest.MonkeyPatch) -> None:
    assert trace_id_from_env() is None
    monkeypatch.setenv("TRACEPARENT", GOOD)
    assert trace_id_from_env() == TRACE
    monkeypatch.setenv("TRACEPARENT", GOOD.upper())
    assert trace_id_from_env() is None
    monkeypatch.setenv("TRACEPARENT", "garbage")
    assert trace_id_from_env() is None


def test_child_env_reaches_trace_id_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    trace_id = new_trace_id()
    for key, value in child_env({}, trace_id, 42).items():
        monkeypatch.setenv(key, value)
    assert trace_id_from_env() == trace_id


def test_format_traceparent_is_what_inject_writes() -> None:
    carrier: dict[str, str] = {}
    inject(carrier, TRACE, SPAN, sampled=False)
    assert carrier["traceparent"] == format_traceparent(TRACE, SPAN, sampled=False)
    assert parse_traceparent(format_traceparent(TRACE, SPAN)) == (TRACE, "00f067aa0ba902b7")


def test_all_names_exist() -> None:
    for name in context.__all__:
        assert hasattr(context, name)
