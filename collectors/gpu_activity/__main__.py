"""``python -m gpu_trace.collectors.gpu_activity``: replay recorded CUPTI records into a run, or
record such a file on a GPU machine.

``replay FILE RUN_DIR`` writes the activity file the injection library would have written
(``spool/gpu_activity-<pid>-replay.bin``), so ``gpu-trace ingest RUN_DIR`` takes it the live road.
``--anchor CUPTI_NS:MONOTONIC_NS`` puts the recorded times on the run's clock (a replay file's
times are CUPTI's: Unix-epoch nanoseconds for ``cupti-python``); ``--thread CUPTI_TID=OS_TID`` maps
the thread ids CUPTI reported (``pthread_self`` values unless the recorder asked for system ids)
to the ones the run's spans carry; ``--pid`` sets the process.

``record-replay OUT -- PROGRAM [ARGS...]`` runs a Python program with ``cupti-python`` subscribed
and writes every record as one JSON line (``pip install cupti-python``; needs a GPU).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gpu_trace.collectors.gpu_activity import activity_file
from gpu_trace.collectors.gpu_activity.conversion import map_threads
from gpu_trace.collectors.gpu_activity.replay_file import read_replay


def _pair(text: str, sep: str) -> tuple[int, int]:
    a, found, b = text.partition(sep)
    if not found:
        raise argparse.ArgumentTypeError(f"expected A{sep}B, got {text!r}")
    try:
        return int(a), int(b)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers in {text!r}") from None


def replay(
    path: Path,
    run_dir: Path,
    *,
    anchor: tuple[int, int] | None = None,
    threads: dict[int, int] | None = None,
    pid: int | None = None,
) -> tuple[Path, int, list[str]]:
    """Write ``path``'s records into ``run_dir``'s spool; the file, the record count, problems."""
    records, names, problems = read_replay(path)
    records = records.copy()
    records["tid"] = map_threads(records["tid"], threads)
    if pid is not None:
        records["pid"] = pid
    owner = int(records["pid"][0]) if len(records) else 0
    data = activity_file.encode(records, names, [anchor] if anchor else None)
    out = run_dir / "spool" / f"{activity_file.PREFIX}{owner}-replay{activity_file.SUFFIX}"
    return activity_file.write(out, data), len(records), problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_trace.collectors.gpu_activity")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("replay", help="write recorded CUPTI records into a run's spool")
    p.add_argument("file", type=Path)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--anchor", type=lambda t: _pair(t, ":"), metavar="CUPTI_NS:MONOTONIC_NS")
    p.add_argument("--thread", type=lambda t: _pair(t, "="), action="append", default=[])
    p.add_argument("--pid", type=int)
    r = sub.add_parser("record-replay", help="record a Python program's CUPTI records (GPU)")
    r.add_argument("out", type=Path)
    r.add_argument("program", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "record-replay":
        from gpu_trace.collectors.gpu_activity.replay_recording import record

        program = args.program[1:] if args.program[:1] == ["--"] else args.program
        if not program:
            parser.error("record-replay needs a program: OUT -- PROGRAM [ARGS...]")
        return record(args.out, program)
    if not args.file.is_file():
        print(f"error: {args.file}: no such file", file=sys.stderr)
        return 2
    out, n, problems = replay(
        args.file, args.run_dir, anchor=args.anchor, threads=dict(args.thread), pid=args.pid
    )
    for line in problems:
        print(f"warning: {line}", file=sys.stderr)
    print(f"{n} records written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
