"""docs/examples/profile_training.ipynb runs in a real Jupyter kernel and shows what it says.

The notebook is committed without outputs; here nbclient runs it in an ipykernel of this
interpreter with GPU_TRACE_HOME in a temporary directory, and its outputs are checked: no error,
a summary naming the model's modules, the timeline as a plotly figure.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import REPO

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("torch")

NOTEBOOK = REPO / "docs" / "examples" / "profile_training.ipynb"
PLOTLY = "application/vnd.plotly.v1+json"


def test_the_notebook_is_committed_without_outputs() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None


def test_the_notebook_runs_in_a_kernel(tmp_path: Path) -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    env = {**os.environ, "GPU_TRACE_HOME": str(tmp_path / "home")}
    client.execute(env=env)

    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    errors = [o for o in outputs if o.output_type == "error"]
    assert not errors, errors[0].get("traceback") if errors else ""

    def shown(source_start: str) -> list[dict]:
        """What the cell starting so showed (its value, or what it displayed: a figure)."""
        cell = next(c for c in nb.cells if c.source.startswith(source_start))
        kinds = ("execute_result", "display_data")
        return [o.get("data", {}) for o in cell.outputs if o.output_type in kinds]

    run = shown("with gpu_trace.profile(")[0]
    assert "finished" in run["text/html"] and "tiny-net training" in run["text/html"]
    summary = shown("summary = run.summary()")[0]
    for module in ("TinyNet.fc1", "TinyNet.act", "TinyNet.fc2", "ProfilerStep", "loss"):
        assert module in summary["text/html"], module
    assert "TinyNet.fc1" in summary["text/plain"], "the text is gpu-trace show's"
    sql = shown("run.sql(")[0]
    assert "TinyNet.fc2" in sql["text/html"]
    figure = shown("run.timeline()")[0]
    assert PLOTLY in figure
    drawn = json.dumps(figure[PLOTLY]["data"])
    assert '"type": "bar"' in drawn and "TinyNet" in drawn
    stored = list((tmp_path / "home" / "runs").iterdir())
    assert len(stored) == 1, "the run went under the kernel's GPU_TRACE_HOME"
