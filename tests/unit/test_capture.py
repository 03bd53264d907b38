"""Attaching framework ranges to a run from above the tracer (``gpu_trace/_capture.py``).

tracer/session.py imports nothing above it: ``gpu_trace.start()`` hands it ``_capture.attach``
and ``stop()`` hands it ``_capture.detach``. A failing attach or detach never breaks the program.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import gpu_trace
from gpu_trace.framework_patches import hooks
from gpu_trace.tracer import recorder, session


def test_start_patches_the_imported_framework_and_stop_unpatches_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPU_TRACE_TORCH", "module")
    assert torch.nn.Linear  # torch is imported: the hook patches it at once
    gpu_trace.start(tmp_path / "run", nvtx="off")
    try:
        assert hooks.is_patched()
    finally:
        gpu_trace.stop()
    assert not hooks.is_patched()


def test_a_failing_attach_or_detach_is_logged_and_recording_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def attach(rec: recorder.Recorder, settings: object) -> None:
        raise RuntimeError("attach broke")

    def detach() -> None:
        raise RuntimeError("detach broke")

    with caplog.at_level(logging.ERROR, logger="gpu_trace.tracer.session"):
        run_dir = session.start_run(tmp_path / "run", attach=attach, nvtx="off")
        assert recorder.active is not None and recorder.active.run_dir == run_dir
        assert session.stop_run(detach=detach) == run_dir
    assert recorder.active is None
    assert [r.exc_info[1].args[0] for r in caplog.records if r.exc_info] == [
        "attach broke",
        "detach broke",
    ]
