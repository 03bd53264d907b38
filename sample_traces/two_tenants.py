"""Two tenants at once: starts two training processes (``train_local.py``) side by side.

Under ``gpu-trace record --remote HOST:PORT`` both children inherit the recording and the
forwarding settings, so each opens its own session on the one server and both land in one run:
the "two-tenant forwarded run" of ``sample_traces/runs/forwarded-two-tenants``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

script = Path(__file__).with_name("train_local.py")
steps = sys.argv[1] if len(sys.argv) > 1 else "6"
procs = [subprocess.Popen([sys.executable, str(script), steps]) for _ in range(2)]
sys.exit(max(p.wait() for p in procs))
