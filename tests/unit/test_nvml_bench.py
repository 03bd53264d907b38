"""bench/collectors.py ends under a pipe: nothing it starts outlives it holding our output.

On the H100, ``timeout 90 python bench/collectors.py --real-nvml --seconds 3 | tail`` printed
nothing for seven minutes: the bench killed its stand-in program but not that program's child,
which slept on for ten minutes with the pipe open, so ``tail`` never saw its end.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_sampler_bench_ends_under_a_pipe() -> None:
    out = subprocess.run(  # communicate() waits for EOF: a leftover grandchild would hang here
        [sys.executable, str(REPO / "bench" / "collectors.py"), "--ticks", "100"]
        + ["--seconds", "0.1", "--warmup", "0.05", "--timeout", "100"],
        capture_output=True,
        text=True,
        timeout=120,  # only a hang gets here
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("sampler") and "nvml (replay nvml-h100.jsonl)" in lines[1]
    assert any(line.startswith("gpu0/temperature") for line in lines)
