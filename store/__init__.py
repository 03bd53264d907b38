"""Where recorded runs go: the ClickHouse client (embedded chDB or a server by DSN), its schema and
read-only rule, ingest of a run's spool, ``gpu-trace import`` of profiler traces, and what stays on
disk after a run is stored. Imports :mod:`gpu_trace.tracer` and nothing above it."""
