"""Make the H100 sample runs name their program and autograd thread as the command did.

The two H100 runs were recorded from a copy of the program named ``wl_gpu_train.py``, started as
``python3 train_lm.py --nvtx`` (their ``run.json`` command), so their processes were named
``wl_gpu_train.py --nvtx``; and a recorder of the time named PyTorch's autograd device thread
``Dummy-1`` (the module run) or not at all (the op run, where the profiler numbered it 2). This
rewrites the ``stats/<pid>.json`` files of both (the op run's inside its ``.tar.gz``): the process
``train_lm.py --nvtx``, the autograd thread ``pt_autograd_0``, the name PyTorch gives it (and
gpu-trace records since issue 29).

Only the stats change, which is where the store's ``threads`` rows come from: the spool files
are kept byte for byte, since ingest logs each by name and size and would store the rows of a
rewritten one again in a store that already holds the sample. Their schema metadata keeps the old
process name. Run from the repository root; running it again changes nothing::

    python sample_traces/rename_h100_program.py
"""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from pathlib import Path

RUNS = Path(__file__).resolve().parent / "runs"
MODULE_RUN = RUNS / "20261124-174647-9ad8eb"
OP_RUN = RUNS / "20261124-174702-6a22f9.tar.gz"
OLD, NEW = "wl_gpu_train.py", "train_lm.py"
#: The autograd device thread of each run: its tid there, as the spans have it.
AUTOGRAD = {"20261124-174647-9ad8eb": "852", "20261124-174702-6a22f9": "2"}
AUTOGRAD_NAME = "pt_autograd_0"


def renamed(text: str, run_id: str) -> str:
    """A stats file's text with the program and the autograd thread renamed (as it was when it
    needs neither)."""
    stats = json.loads(text)
    name = str(stats.get("process_name", ""))
    if not name.startswith(OLD):
        return text
    stats["process_name"] = NEW + name.removeprefix(OLD)
    stats.setdefault("threads", {})[AUTOGRAD[run_id]] = AUTOGRAD_NAME
    return json.dumps(stats)


def rename_module_run() -> None:
    for path in sorted((MODULE_RUN / "stats").glob("*.json")):
        text = path.read_text()
        new = renamed(text, MODULE_RUN.name)
        if new != text:
            path.write_text(new)


def rename_op_run() -> None:
    """Rewrite the stats inside the packed run; every other member is copied as it is, in the
    same order, with the same times and modes."""
    run_id = OP_RUN.name.removesuffix(".tar.gz")
    out = io.BytesIO()
    changed = False
    with tarfile.open(OP_RUN, "r:gz") as src, tarfile.open(fileobj=out, mode="w") as dst:
        for member in src:
            data = src.extractfile(member).read() if member.isfile() else None  # type: ignore[union-attr]
            if data is not None and member.name.startswith(f"{run_id}/stats/"):
                new = renamed(data.decode(), run_id).encode()
                changed |= new != data
                data = new
                member.size = len(data)
            dst.addfile(member, io.BytesIO(data) if data is not None else None)
    if changed:
        tmp = OP_RUN.with_name(f".{OP_RUN.name}.tmp")
        with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
            gz.write(out.getvalue())
        tmp.replace(OP_RUN)


if __name__ == "__main__":
    rename_module_run()
    rename_op_run()
