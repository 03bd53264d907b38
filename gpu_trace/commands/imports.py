"""`gpu-trace import`: a PyTorch profiler (Kineto) trace file, or a file `gpu-trace export` wrote,
into the store as a run."""

from __future__ import annotations

import argparse

from gpu_trace.commands import CLIError, echo
from gpu_trace.commands.runs import checked_dsn, store_module


def cmd_import(args: argparse.Namespace) -> int:
    from gpu_trace.tracer.importer import TraceImportError, import_trace

    dsn = checked_dsn(args.store)
    store_mod = store_module()
    try:
        with store_mod.Store(dsn) as store:
            report = import_trace(store, args.trace, name=args.name)
    except TraceImportError as exc:
        raise CLIError(f"import: {exc}; nothing was stored") from None
    except store_mod.StoreError as exc:
        raise CLIError(f"import failed, nothing was stored: {exc}") from None
    echo(report.summary())
    return 0
