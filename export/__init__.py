"""Runs out of the store: the exporter seam (:mod:`gpu_trace.export.exporter`), Chrome trace JSON
(Perfetto, HTA) and its flow arrows, and OpenTelemetry (OTLP mapping, its endpoint, the stream that
follows a recording run's spool)."""
