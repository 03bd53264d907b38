"""Instructions per training step of bench/patch_overhead.py's PyTorch models, per configuration.

    python bench/patch_instructions.py [--models CNN,LSTM,MLP] [--steps 4]

Timings on a shared machine move by several percent from round to round; instruction counts do
not depend on the machine's load. This runs the same models and configurations as
``patch_overhead.py`` (unpatched, module level, op level, op level with hooks, torch.profiler)
under ``valgrind --tool=callgrind``, counting only the training thread and only the measured
steps: a tiny C library (built here with the system's C compiler and valgrind's headers) toggles
callgrind's collection around them. Reported: instructions per step, and the ratio to
unpatched. Instructions are not time: a cache miss counts once however long it stalls (add
``--cache-sim`` for callgrind's estimate of those). Slow: valgrind runs Python about 50 times
slower, about 20 minutes for the three models.

Op level's sessions are cycled by wall time (every 2 s), which valgrind stretches: here they are
not cycled inside the measured steps.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

_TOGGLE_C = """
#include <valgrind/callgrind.h>
void cg_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
void cg_zero(void) { CALLGRIND_ZERO_STATS; }
void cg_dump(const char *s) { CALLGRIND_DUMP_STATS_AT(s); }
"""
_ENV = "GPU_TRACE_BENCH_CALLGRIND_LIB"
CONFIGS = (
    "unpatched",
    "gpu-trace module",
    "gpu-trace op",
    "gpu-trace op, hooks",
    "torch.profiler (CPU)",
)


def inside(models: list[str], steps: int) -> None:
    """Under valgrind: run each configuration's steps with collection on, one dump each."""
    cg = ctypes.CDLL(os.environ[_ENV])
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import patch_overhead as po

    from gpu_trace.framework_patches.torch import ops as torch_ops

    torch_ops.HARVEST_INTERVAL_S = 1e9
    po.steady_allocator()
    cases = po.torch_cases()
    configs = {k: v for k, v in po.torch_configs().items() if k in CONFIGS}
    for name in models:
        step, calls = cases[name]()
        for cname, ctx in configs.items():
            with ctx():
                for _ in range(3):
                    step()
                cg.cg_zero()
                cg.cg_toggle()
                for _ in range(steps):
                    step()
                cg.cg_toggle()
                cg.cg_dump(f"{name}|{cname}|{calls}|{steps}".encode())


def outside(models: list[str], steps: int, cache_sim: bool) -> int:
    for tool in ("valgrind", "cc"):
        if shutil.which(tool) is None:
            print(f"{tool} is needed (apt-get install valgrind gcc)", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory() as d:
        src, lib = os.path.join(d, "toggle.c"), os.path.join(d, "toggle.so")
        with open(src, "w") as f:
            f.write(_TOGGLE_C)
        built = subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", lib, src], text=True)
        if built.returncode != 0:
            print("could not build the toggle library (valgrind's headers?)", file=sys.stderr)
            return 2
        out = os.path.join(d, "cg.out")
        cmd = [
            "valgrind",
            "--tool=callgrind",
            "--collect-atstart=no",
            "--separate-threads=yes",
            f"--callgrind-out-file={out}",
            *(["--cache-sim=yes"] if cache_sim else []),
            sys.executable,
            os.path.abspath(__file__),
            "--models",
            ",".join(models),
            "--steps",
            str(steps),
        ]
        env = dict(os.environ, **{_ENV: lib})
        run = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if run.returncode != 0:
            print(run.stderr.decode(errors="replace")[-3000:], file=sys.stderr)
            return 1
        rows = []
        for path in glob.glob(out + ".*-01"):  # the dumps of the training (main) thread
            with open(path, errors="replace") as f:
                text = f.read()
            label = re.search(r"^desc: Trigger: Client Request: (.*)$", text, re.M)
            total = re.search(r"^(?:totals|summary): (\d+)", text, re.M)
            if label and total:
                rows.append((label.group(1).split("|"), int(total.group(1))))
    print(f"instructions per step, training thread only, {steps} steps per configuration")
    for name in models:
        got = {c: n for (m, c, _, s), n in rows if m == name}
        calls = next((int(k) for (m, _, k, _), _n in rows if m == name), 0)
        base = got.get("unpatched")
        print(f"\n{name}: {calls} module calls/step")
        print(
            f"  {'configuration':22} | {'M instr/step':>12} | {'ratio':>6} | {'k instr/call':>12}"
        )
        for c in CONFIGS:
            if c in got and base:
                per = got[c] / steps
                print(
                    f"  {c:22} | {per / 1e6:12.3f} | {got[c] / base:6.4f} |"
                    f" {(got[c] - base) / steps / max(calls, 1) / 1e3:12.1f}"
                )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="CNN,LSTM,MLP", help="comma-separated")
    ap.add_argument("--steps", type=int, default=4, help="measured steps per configuration")
    ap.add_argument("--cache-sim", action="store_true", help="callgrind's cache simulation too")
    args = ap.parse_args()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if os.environ.get(_ENV):
        inside(models, args.steps)
        return 0
    return outside(models, args.steps, args.cache_sim)


if __name__ == "__main__":
    sys.exit(main())
