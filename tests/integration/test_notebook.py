"""docs/examples/profile_training.ipynb runs in a real Jupyter kernel and shows what it says, and
is committed with the outputs of such a run, which show without a kernel.

scripts/refresh_notebook.py runs it with nbclient in an ipykernel of this interpreter with
GPU_TRACE_HOME in a temporary directory (and writes it back for a human refreshing it); here its
outputs are checked: no error, a summary naming the model's modules, the timeline as a plotly
figure and a PNG (what GitHub and nbconvert's HTML show), counter panels that each draw a line.
The committed notebook must hold the same kinds of outputs, so a change to a cell that is not
refreshed fails here.
"""

from __future__ import annotations

import base64
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("torch")
pytest.importorskip("matplotlib")

NOTEBOOK = REPO / "docs" / "examples" / "profile_training.ipynb"
PLOTLY = "application/vnd.plotly.v1+json"
PNG = b"\x89PNG\r\n\x1a\n"


def _script() -> Any:
    spec = importlib.util.spec_from_file_location(
        "refresh_notebook", REPO / "scripts" / "refresh_notebook.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _shown(nb: Any, source_start: str) -> list[dict]:
    """What the cell starting so showed (its value, or what it displayed: a figure)."""
    cell = next(c for c in nb.cells if c.source.startswith(source_start))
    kinds = ("execute_result", "display_data")
    return [o.get("data", {}) for o in cell.outputs if o.output_type in kinds]


def _kinds(nb: Any) -> list[list[tuple[str, tuple[str, ...]]]]:
    """Per code cell, its outputs' types and mime types."""
    return [
        [(o.output_type, tuple(sorted(o.get("data", {})))) for o in c.outputs]
        for c in nb.cells
        if c.cell_type == "code"
    ]


def _check_timeline(data: dict) -> None:
    png = base64.b64decode(data["image/png"])
    assert png.startswith(PNG) and len(png) > 10_000, "a picture of the figure"
    assert "text/html" not in data, "nbconvert would pick plotly's HTML, blank without its script"
    panels = [a["text"] for a in data[PLOTLY]["layout"]["annotations"]]
    assert "user/loss" in panels
    lines = [t for t in data[PLOTLY]["data"] if t.get("meta") in panels]
    for panel in panels:  # no empty axes: each panel's line has two points at least
        assert any(len(t["x"]) > 1 for t in lines if t["meta"] == panel), panel


def test_the_notebook_runs_in_a_kernel(tmp_path: Path) -> None:
    script = _script()
    nb = script.execute(NOTEBOOK, tmp_path / "home")
    assert not script.errors(nb), script.errors(nb)[0]

    run = _shown(nb, "with gpu_trace.profile(")[0]
    assert "finished" in run["text/html"] and "tiny-net training" in run["text/html"]
    assert "$GPU_TRACE_HOME" in run["text/html"] and str(tmp_path) not in json.dumps(nb.cells)
    summary = _shown(nb, "summary = run.summary()")[0]
    for module in ("TinyNet.fc1", "TinyNet.act", "TinyNet.fc2", "ProfilerStep", "loss"):
        assert module in summary["text/html"], module
    assert "TinyNet.fc1" in summary["text/plain"], "the text is gpu-trace show's"
    sql = _shown(nb, "run.sql(")[0]
    assert "TinyNet.fc2" in sql["text/html"]
    figure = _shown(nb, "run.timeline(static=True)")[0]
    drawn = json.dumps(figure[PLOTLY]["data"])
    assert '"type": "bar"' in drawn and "TinyNet" in drawn
    _check_timeline(figure)
    stored = list((tmp_path / "home" / "runs").iterdir())
    assert len(stored) == 1, "the run went under the kernel's GPU_TRACE_HOME"
    assert all("execution" not in c.metadata for c in nb.cells), "no timings to churn"

    committed = nbformat.read(NOTEBOOK, as_version=4)
    assert [c.source for c in committed.cells] == [c.source for c in nb.cells]
    assert _kinds(committed) == _kinds(nb), (
        "the committed outputs are stale: python scripts/refresh_notebook.py"
    )


def test_the_notebook_is_committed_with_outputs_that_show_without_a_kernel() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.outputs for c in code[1:]), "every code cell but the set-up shows something"
    assert not _script().errors(nb)
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), "one fresh run"
    assert all("execution" not in c.metadata for c in nb.cells)
    assert nb.metadata.get("language_info") == {"name": "python"}
    _check_timeline(_shown(nb, "run.timeline(static=True)")[0])
    assert "/tmp/" not in json.dumps([c.outputs for c in code]), "no temporary paths"
