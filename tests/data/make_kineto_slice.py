"""Cut the first steps out of the real H100 Kineto trace, for tests that run HTA in seconds.

``kineto-h100-lm.json.gz`` (60 training steps, 391,584 events) takes HTA about 10 s to load on a
loaded 2-core machine; the first ``--steps`` steps (default 5) keep every kind of event in the
same proportions. A step ends where its ``Optimizer.step#AdamW.step`` annotation ends (the trace
has no ``ProfilerStep#N``). Kept: every CPU event and flow start before the cut, every
metadata event, and the device work, ``ac2g`` flow ends and GPU annotations whose launching call
(by ``correlation``, or its ``External id``) is kept; the top-level metadata as it is.

    python tests/data/make_kineto_slice.py tests/data/kineto-h100-lm.json.gz \\
        tests/data/kineto-h100-lm-5steps.json.gz --steps 5
"""

from __future__ import annotations

import argparse
import gzip
import json

DEVICE = ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source")
    ap.add_argument("target")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    with gzip.open(args.source, "rt") as f:
        data = json.load(f)  # floats: their shortest repr reads back as the same value
    events = data["traceEvents"]
    ends = sorted(
        e["ts"] + e["dur"]
        for e in events
        if e.get("cat") == "user_annotation" and e["name"].startswith("Optimizer.step#")
    )
    cut = ends[args.steps - 1]
    cpu = [e for e in events if e.get("ph") == "X" and e.get("cat") not in DEVICE]
    kept_cpu = [e for e in cpu if e["ts"] < cut and e.get("cat") != "Trace"]
    corr = {e["args"]["correlation"] for e in kept_cpu if "correlation" in e.get("args", {})}
    ext = {e["args"]["External id"] for e in kept_cpu if "External id" in e.get("args", {})}
    out = []
    for e in events:
        ph, cat, a = e.get("ph"), e.get("cat"), e.get("args", {})
        if ph == "M":
            out.append(e)
        elif ph == "X" and cat in DEVICE:
            if a.get("correlation") in corr or (
                "correlation" not in a and a.get("External id") in ext
            ):
                out.append(e)
        elif ph == "X":
            if e["ts"] < cut and cat != "Trace":
                out.append(e)
        elif cat == "ac2g":
            if e["id"] in corr:
                out.append(e)
        elif ph in ("s", "f") and e["ts"] < cut:
            out.append(e)
    data["traceEvents"] = out
    with gzip.GzipFile(args.target, "wb", mtime=0) as f:
        f.write(json.dumps(data).encode())


if __name__ == "__main__":
    main()
