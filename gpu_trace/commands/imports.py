"""`gpu-trace import`: a PyTorch profiler (Kineto) trace file, or a file `gpu-trace export` wrote,
into the store as a run."""

from __future__ import annotations

import argparse
import sys

from gpu_trace.commands import CLIError, echo
from gpu_trace.commands.runs import checked_dsn, store_module


def cmd_import(args: argparse.Namespace) -> int:
    from gpu_trace._progress import PhaseProgress
    from gpu_trace.store.importer import import_trace
    from gpu_trace.store.trace_file import TraceImportError

    dsn = checked_dsn(args.store)
    store_mod = store_module()
    progress = PhaseProgress(sys.stderr, prefix="import")  # on a terminal only
    try:
        with store_mod.Store(dsn) as store:
            report = import_trace(store, args.trace, name=args.name, progress=progress)
    except TraceImportError as exc:
        raise CLIError(f"import: {exc}; nothing was stored") from None
    except store_mod.StoreError as exc:
        raise CLIError(f"import failed, nothing was stored: {exc}") from None
    finally:
        progress.close()
    echo(report.summary())
    return 0
