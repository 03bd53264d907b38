"""Started by `gpu-trace record` through PYTHONPATH: recording begins before the program's first line.

Every Python process of the run (the program, its subprocesses, multiprocessing's spawned workers)
inherits the environment and so runs this. A sitecustomize of the user's own that this one shadows
is executed afterwards.
"""

import os
import sys


def _start() -> None:
    if not os.environ.get("GPU_TRACE_RUN_DIR"):
        return
    try:
        from gpu_trace import _capture
        from gpu_trace.tracer.session import start_from_env

        start_from_env(attach=_capture.attach)
    except Exception as exc:  # never break the traced program
        sys.stderr.write(f"gpu-trace: recording is off in this process: {exc}\n")


def _remote() -> None:
    # `gpu-trace record --remote`: forward the program's CUDA work once it imports torch.
    if not os.environ.get("GPU_TRACE_REMOTE"):
        return
    try:
        from gpu_trace.runtime.client.cuda import install_from_env

        install_from_env()
    except Exception as exc:  # never break the traced program
        sys.stderr.write(f"gpu-trace: CUDA forwarding is off in this process: {exc}\n")


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            with open(candidate, "rb") as f:
                code = compile(f.read(), candidate, "exec")
            exec(code, {"__name__": "sitecustomize", "__file__": candidate})
            return


_start()
_remote()
_chain()
