"""Every read of a stored run, typed. Reads go through a :class:`~gpu_trace.query.source.Source`
(a store opened for reading, or the dashboard's guarded one); the CLI, the dashboard and ``Run``
only format what this package returns, and no SQL is written outside it and the store
(``tests/unit/test_layers.py``).

- ``reads``: runs, a run from its reference, counts, threads, clock samples, forwarded ops' time,
  spans and counters in pages;
- ``summary``: the run's summary (``show``, ``Run.summary()``): lanes, ranges, steps, counters;
- ``gpu``: GPU work per device with the one busy time; ``gpu_work``: the same per step and lane;
- ``distributed``: ranks, collectives linked across them, stragglers, per-step figures;
- ``windows``, ``overview``, ``series``, ``relatives``, ``matches``: the timeline's tracks,
  windows at each level of detail, counter series, a span's relatives, span search;
- ``tenancy``: tenants of a forwarding server's run; ``module_tree``: the module tree;
  ``frames``: spans and counters as Arrow for ``Run``; ``nesting``: the rule spans nest by.
"""
