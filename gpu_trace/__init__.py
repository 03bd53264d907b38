"""gpu-trace: profiling and observability for local and forwarded GPU work.

The API records into the active run (``gpu-trace record`` starts one before the program's first
line, or call :func:`start`)::

    import gpu_trace

    for i, batch in enumerate(loader):
        gpu_trace.step(i)
        with gpu_trace.range("forward", batch=i):
            loss = model(batch)
        gpu_trace.counter("loss", loss.item())
"""

from gpu_trace._api import counter, mark, range, start, step, stop

__version__ = "0.1.0"

__all__ = ["__version__", "counter", "mark", "range", "start", "step", "stop"]
