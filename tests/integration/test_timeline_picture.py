"""``Run.timeline()``'s counter panels and its picture (``static=True``), on a real chDB store.

A counter panel is drawn only for a counter with a line to draw in the window: a short block
has one host sample at most, and a panel of one sample was empty axes (the example notebook
showed three such). ``static=True`` adds a PNG drawn with matplotlib, offered to Jupyter beside
plotly's own mime type and without plotly's HTML, which viewers without JavaScript would pick
and show blank.
"""

from __future__ import annotations

import base64
import time

import pytest

import gpu_trace
from gpu_trace import run_view

pytest.importorskip("pandas")
pytest.importorskip("plotly")
pytest.importorskip("matplotlib")

PNG = b"\x89PNG\r\n\x1a\n"
PLOTLY = "application/vnd.plotly.v1+json"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> gpu_trace.Run:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("GPU_TRACE_HOME", str(tmp_path_factory.mktemp("timeline-home")))
        with gpu_trace.profile(name="panels", nvml=False, host=False, nvtx="off") as run:
            gpu_trace.counter("once", 7.0)  # one sample: no line
            for i in range(3):
                gpu_trace.step(i)
                with gpu_trace.range("work", i=i):
                    time.sleep(0.002)
                gpu_trace.counter("loss", 1.0 / (i + 1))
    return run


def _panels(figure: dict) -> list[str]:
    return [a["text"] for a in figure["layout"]["annotations"]]


def test_only_counters_with_a_line_get_a_panel(run: gpu_trace.Run) -> None:
    figure = run.timeline().to_plotly_json()
    assert _panels(figure) == ["user/loss"], "user/once has one sample: no empty axes for it"
    asked = run.timeline(counters=["user/once", "user/loss"]).to_plotly_json()
    assert _panels(asked) == ["user/once", "user/loss"], "a counter asked for is drawn as asked"


def test_drawable_needs_two_samples_reaching_the_window() -> None:
    def rows(*ts: int) -> list[dict[str, object]]:
        return [{"series": "vm", "ts_ns": t, "value": 1.0} for t in ts]

    assert not run_view._drawable(rows(50), 100), "one sample before the window"
    assert not run_view._drawable(rows(150), 100), "one sample in it"
    assert run_view._drawable(rows(50, 150), 100)
    assert run_view._drawable(rows(50, 900), 100), "before and after: a line across it"
    assert not run_view._drawable([], 100)


def test_static_figure_carries_its_picture(
    run: gpu_trace.Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    import plotly.io as pio

    figure = run.timeline(static=True, width=800)
    assert figure.png.startswith(PNG)
    again = run.timeline(static=True, width=800)
    assert figure.png == again.png, "the same figure, the same bytes: a refresh churns no more"
    assert b"matplotlib" not in figure.png, "no version in the PNG's metadata"
    # Jupyter's renderer offers plotly's mime type and its HTML; the HTML goes, the PNG comes.
    monkeypatch.setattr(pio.renderers, "default", "plotly_mimetype+notebook")
    bundle = figure._repr_mimebundle_()
    assert PLOTLY in bundle and "text/html" not in bundle
    assert base64.b64decode(bundle["image/png"]) == figure.png
    assert "text/plain" in bundle
    plain = run.timeline()
    assert not hasattr(plain, "png"), "without static=True the figure is plotly's own"
