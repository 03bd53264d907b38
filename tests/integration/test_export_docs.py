"""docs/export.md's Python examples run as written against a stored run (issue 29 found one using
an undefined ``store`` and a private import only)."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

BLOCKS = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "export.md").read_text(), re.S)


def _run(args: list[str], cwd: Path, home: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        args,
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "GPU_TRACE_HOME": str(home)},
        timeout=240,
    )


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("home")
    prog = home / "prog.py"
    prog.write_text("import gpu_trace\nwith gpu_trace.range('step'):\n    pass\n")
    out = _run([sys.executable, "-m", "gpu_trace", "record", "--", sys.executable, str(prog)],
               home, home)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return home


@pytest.mark.parametrize("index", [0, 1], ids=["run-export", "write-chrome-trace"])
def test_the_python_examples_run_as_written(stored: Path, tmp_path: Path, index: int) -> None:
    assert len(BLOCKS) >= 2 and "import" in BLOCKS[index]
    (tmp_path / "traces").mkdir()
    script = tmp_path / "example.py"
    script.write_text(BLOCKS[index])
    out = _run([sys.executable, str(script)], tmp_path, stored)
    assert out.returncode == 0, out.stderr
    events = json.loads(gzip.decompress((tmp_path / "trace.json.gz").read_bytes()))
    assert any(e.get("name") == "step" for e in events["traceEvents"])
    if index == 0:
        info = json.loads((tmp_path / "traces" / "rank-3.json").read_text())["distributedInfo"]
        assert info == {"rank": 3, "world_size": 4}
