"""Started by `gpu-trace record` through PYTHONPATH: recording begins before the program's first line.

Every Python process of the run (the program, its subprocesses, multiprocessing's spawned workers)
inherits the environment and so runs this. Then it steps aside, so the program sees what it would
see plain (docs/frameworks.md, "What recording leaves untouched"): this folder leaves
``sys.path`` (PYTHONPATH keeps it, for child processes), and ``sys.modules["sitecustomize"]`` is
the user's own sitecustomize that this one shadows (imported here, after recording started) or,
when there is none, nothing: ending with ``ImportError(name="sitecustomize")`` is how ``site``
is told there is no sitecustomize, and it says nothing.
"""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _start() -> None:
    if not os.environ.get("GPU_TRACE_RUN_DIR"):
        return
    try:
        from gpu_trace import _capture
        from gpu_trace.tracer.session import start_from_env

        rec = start_from_env(attach=_capture.attach)
    except Exception as exc:  # never break the traced program
        sys.stderr.write(f"gpu-trace: recording is off in this process: {exc}\n")
        return
    try:
        # A rank of a distributed job (torchrun, mpirun, srun): its place in the job, from the
        # launcher's environment; torch.distributed completes it once a process group exists.
        from gpu_trace.tracer import ranks

        if rec is not None:
            ranks.write(rec.run_dir, ranks.from_env())
    except Exception:  # never break the traced program
        pass


def _echo_signals() -> None:
    # `gpu-trace record` asks whether a signal it got reached the program too (signal_echo.py).
    if not os.environ.get("GPU_TRACE_SIGNAL_ECHO"):
        return
    try:
        from gpu_trace.signal_echo import echo_from_env

        echo_from_env()
    except Exception:  # never break the traced program: record then forwards as before
        pass


def _remote() -> None:
    # `gpu-trace record --remote`: forward the program's CUDA work once it imports torch.
    if not os.environ.get("GPU_TRACE_REMOTE"):
        return
    try:
        from gpu_trace.runtime.client.cuda import install_from_env

        install_from_env()
    except Exception as exc:  # never break the traced program
        sys.stderr.write(f"gpu-trace: CUDA forwarding is off in this process: {exc}\n")


def _leave_path() -> None:
    sys.path[:] = [p for p in sys.path if not p or os.path.abspath(p) != _HERE]


def _chain() -> bool:
    """Import the sitecustomize this one shadows (found on ``sys.path``, which no longer has this
    folder) as ``sitecustomize``; False if there is none. Its errors propagate, as they would
    plain (``site`` prints them and goes on)."""
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path)
    if spec is None or spec.loader is None:
        return False
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module  # replaces this one (importlib allows it)
    spec.loader.exec_module(module)
    return True


_start()
_echo_signals()
_remote()
_leave_path()
if not _chain():
    raise ImportError("no sitecustomize besides gpu-trace's", name="sitecustomize")
