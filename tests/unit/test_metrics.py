"""Prometheus text exposition: escaping, value formats, and what prometheus_client parses back."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpu_trace.runtime.server.metrics import Family, exposition, format_value, is_loopback


def test_labels_and_help_are_escaped_and_parse_back() -> None:
    nasty = 'a "quoted" back\\slash\nnew line'
    fam = Family("tenant_sessions", "gauge", "Help with a back\\slash\nand a new line")
    fam.add({"tenant": nasty, "session": 7}, 3)
    fam.add({"tenant": "plain"}, None)  # no value: no sample
    counter = Family("tenant_ops_total", "counter", "Ops")
    counter.add({"tenant": nasty}, 12)
    text = exposition([fam, counter, Family("empty", "gauge", "no samples: left out")])
    assert "gpu_trace_empty" not in text
    assert "# HELP gpu_trace_tenant_sessions Help with a back\\\\slash\\nand a new line" in text
    assert "# TYPE gpu_trace_tenant_ops_total counter" in text
    parsed = {f.name: f for f in text_string_to_metric_families(text)}
    (sample,) = parsed["gpu_trace_tenant_sessions"].samples
    assert sample.labels == {"tenant": nasty, "session": "7"} and sample.value == 3
    assert parsed["gpu_trace_tenant_sessions"].documentation == (
        "Help with a back\\slash\nand a new line"
    )
    (total,) = parsed["gpu_trace_tenant_ops"].samples
    assert total.name == "gpu_trace_tenant_ops_total" and total.value == 12
    assert parsed["gpu_trace_tenant_ops"].type == "counter"
    assert text.endswith("\n")


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (3, "3"),
        (True, "1"),
        (0.25, "0.25"),
        (1e-9, "1e-09"),
        (math.nan, "NaN"),
        (math.inf, "+Inf"),
        (-math.inf, "-Inf"),
        (1 << 40, "1099511627776"),
    ],
)
def test_values(value: float, text: str) -> None:
    assert format_value(value) == text


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("gpu-box", False),
    ],
)
def test_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
