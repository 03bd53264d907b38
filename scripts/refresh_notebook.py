"""Run docs/examples/profile_training.ipynb in a real Jupyter kernel and write it back with outputs.

    python scripts/refresh_notebook.py [NOTEBOOK] [--check]

The notebook is committed with the outputs of a run, so GitHub and nbconvert's HTML show its
tables and its timeline (as a PNG beside the interactive figure) without a kernel. This executes
it with nbclient in an ipykernel of this interpreter, the run stored under a temporary
GPU_TRACE_HOME, and writes it back, cleaned so that a refresh changes only what the run itself
changes: no timing metadata, the kernel's language_info as committed, the temporary home written
as ``$GPU_TRACE_HOME``. What still differs from one refresh to the next is the run: its id, its
times and durations, the kernel's pid in the track names, the figure's numbers and picture.
``--check`` executes it and writes nothing; exits 1 if a cell raised. Needs the dev extra
(nbclient, nbformat, ipykernel, torch, matplotlib). tests/integration/test_notebook.py runs
:func:`execute` too.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "docs" / "examples" / "profile_training.ipynb"
HOME_TEXT = "$GPU_TRACE_HOME"


def execute(path: Path, home: Path, timeout_s: int = 240) -> Any:
    """The notebook at ``path`` executed (an nbformat node), its run stored under ``home``, and
    cleaned (:func:`clean`). A cell that raises stops it with nbclient's CellExecutionError."""
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    committed = copy.deepcopy(nb.metadata)
    client = nbclient.NotebookClient(
        nb,
        timeout=timeout_s,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(home.parent)}},
    )
    client.execute(env={**os.environ, "GPU_TRACE_HOME": str(home)})
    return clean(nb, home, committed)


def clean(nb: Any, home: Path, metadata: dict[str, Any]) -> Any:
    """``nb`` without what changes with the machine rather than the run: the temporary home in
    outputs (as ``$GPU_TRACE_HOME``), the kernel's filled-in language_info (``metadata`` back)."""
    import nbformat

    nb.metadata = nbformat.from_dict(metadata)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code" and cell.outputs:
            text = json.dumps(cell.outputs).replace(str(home), HOME_TEXT)
            cell.outputs = nbformat.from_dict(json.loads(text))
    return nb


def errors(nb: Any) -> list[str]:
    """The error outputs of ``nb``, as their tracebacks."""
    return [
        "\n".join(o.get("traceback", [])) or o.get("ename", "error")
        for cell in nb.cells
        if cell.cell_type == "code"
        for o in cell.outputs
        if o.output_type == "error"
    ]


def main(argv: list[str] | None = None) -> int:
    import nbformat

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("notebook", nargs="?", type=Path, default=NOTEBOOK)
    ap.add_argument("--check", action="store_true", help="execute only; write nothing")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gpu-trace-notebook-") as tmp:
        try:
            nb = execute(args.notebook, Path(tmp) / "home")
        except Exception as exc:  # nbclient's CellExecutionError names the cell
            print(f"refresh_notebook: {args.notebook} failed: {exc}", file=sys.stderr)
            return 1
    if errors(nb):
        print(f"refresh_notebook: {args.notebook}: {errors(nb)[0]}", file=sys.stderr)
        return 1
    if not args.check:
        nbformat.write(nb, args.notebook)
        print(f"refresh_notebook: wrote {args.notebook} with its outputs", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
