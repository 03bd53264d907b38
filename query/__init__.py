"""Every read of a stored run, typed: runs and their resolution, spans and counters, the run's
summary, GPU work, ranks, nesting. Reads go through a :class:`~gpu_trace.query.source.Source`
(a store opened for reading, or the dashboard's guarded one); the CLI, the dashboard and ``Run``
only format what this package returns."""
