"""Two tenants at once: starts two training processes (``train_local.py``) side by side, each
with its own tenant's token (``tenants.toml``); bob's stops half-way for longer than its
``idle_s``, so the server pages its tensors out and brings them back.

Under ``gpu-trace record --remote HOST:PORT`` both children inherit the recording and the
forwarding settings, so each opens its own session on the one server (``gpu-trace serve
--tenants sample_traces/tenants.toml``) and both land in one run: the "two-tenant forwarded
run" of ``sample_traces/runs/forwarded-two-tenants``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

script = Path(__file__).with_name("train_local.py")
steps = sys.argv[1] if len(sys.argv) > 1 else "6"
tenants = {  # tenant: (token, extra arguments)
    "alice": ("alice-sample-token-0123456789", []),
    "bob": ("bob-sample-token-0123456789", ["2.5"]),
}
procs = [
    subprocess.Popen(
        [sys.executable, str(script), steps, *extra],
        env={**os.environ, "GPU_TRACE_REMOTE_TOKEN": token},
    )
    for token, extra in tenants.values()
]
sys.exit(max(p.wait() for p in procs))
