"""gpu-trace: profiling and observability for local and forwarded GPU work.

The API records into the active run (``gpu-trace record`` starts one before the program's first
line, or call :func:`start`)::

    import gpu_trace

    for i, batch in enumerate(loader):
        gpu_trace.step(i)
        with gpu_trace.range("forward", batch=i):
            loss = model(batch)
        gpu_trace.counter("loss", loss.item())

Or record a block in-process and read it back (a notebook cell, a part of a script)::

    with gpu_trace.profile() as run:
        train(model, loader)
    run.summary()        # DataFrames: top ranges per lane, steps, counters
    run.timeline()       # the dashboard's timeline, a plotly Figure

:func:`runs` lists stored runs and :func:`run` opens one (``gpu_trace.run("last")``).
"""

from gpu_trace._api import counter, mark, range, start, step, stop
from gpu_trace.profiling import profile
from gpu_trace.run_view import Run, run, runs

__version__ = "0.1.0"

__all__ = [
    "Run",
    "__version__",
    "counter",
    "mark",
    "profile",
    "range",
    "run",
    "runs",
    "start",
    "step",
    "stop",
]
