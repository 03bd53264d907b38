"""Figures from what :mod:`gpu_trace.query` returns: the timeline and the report charts as
plotly figures (:mod:`.figures`, :mod:`.charts`), and a timeline figure drawn as a PNG with
matplotlib (:mod:`.picture`). No store and no Dash: the dashboard and ``Run.timeline`` draw
with these."""
