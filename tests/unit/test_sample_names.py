"""The sample runs name their programs and threads as their commands did: a program's process
name (``stats/<pid>.json``, where the store's ``threads`` rows come from) is the file its run's
command ran, and no thread is ``threading``'s made-up ``Dummy-N``. The H100 runs were recorded
from a copy of ``train_lm.py`` named otherwise (``sample_traces/rename_h100_program.py``)."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

RUNS = Path(__file__).resolve().parents[2] / "sample_traces" / "runs"


def sample_runs() -> list[tuple[str, dict, list[dict]]]:
    """Each sample run: its name, run.json and stats files, packed ones read from the archive."""
    out = []
    for path in sorted(RUNS.iterdir()):
        if path.is_dir():
            run = json.loads((path / "run.json").read_text())
            stats = [json.loads(p.read_text()) for p in sorted((path / "stats").glob("*.json"))]
        elif path.name.endswith(".tar.gz"):
            with tarfile.open(path) as tar:
                files = {
                    m.name.split("/", 1)[1]: tar.extractfile(m).read()  # type: ignore[union-attr]
                    for m in tar
                    if m.isfile() and m.name.endswith(".json")
                }
            run = json.loads(files["run.json"])
            stats = [json.loads(v) for k, v in sorted(files.items()) if k.startswith("stats/")]
        else:
            continue
        out.append((path.name, run, stats))
    return out


@pytest.mark.parametrize("name, run, stats", [pytest.param(*r, id=r[0]) for r in sample_runs()])
def test_programs_and_threads_are_named_as_run(name: str, run: dict, stats: list[dict]) -> None:
    (script,) = [Path(w).name for w in run["command"].split() if w.endswith(".py")]
    names = [s["process_name"] for s in stats]
    assert script in [n.split()[0] for n in names], f"{name}: {run['command']!r}, {names}"
    threads = [t for s in stats for t in s.get("threads", {}).values()]
    assert not [t for t in threads if t.startswith("Dummy-")], f"{name}: {threads}"
