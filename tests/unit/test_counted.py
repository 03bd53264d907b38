"""Counts in the CLI's lines take their noun's number: "in 1 request", "left out: Trace events
(1)", "loaded (1 file)"; issue 29 found "in 1 requests" and "1 Trace events"."""

from __future__ import annotations

from gpu_trace import _format as fmt
from gpu_trace.store.importer import ImportReport


def test_a_count_and_its_noun() -> None:
    assert fmt.counted(1, "request") == "1 request"
    assert fmt.counted(0, "request") == "0 requests"
    assert fmt.counted(1024, "file") == "1,024 files"
    assert fmt.counted(2, "batch", "batches") == "2 batches"


def test_what_an_import_left_out_reads_as_counts_of_kinds() -> None:
    skipped = {"Trace events": 1, "'i' events": 2}
    report = ImportReport(run_id="r", counts={"op": 3}, skipped=skipped, linked=0, seconds=0.5)
    assert report.summary().endswith("left out: Trace events (1), 'i' events (2) (0.5 s)")
