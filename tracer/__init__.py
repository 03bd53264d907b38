"""Event records, the recorder, clocks and clock sync, trace context, spool files, the store and exporters."""
