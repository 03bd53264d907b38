"""GPU activity: every kernel, copy, memset and CUDA call, tied to the op that launched it.

Captured by CUPTI's Activity API from an injection library the CUDA driver loads in every process
of the run (``injection.c``, ``library.py``); raw records go to the run's spool
(``activity_file.py``) and become spans before ingest (``converter.py``, ``conversion.py``).
Recorded records replay through the same path (``replay_file.py``). See docs/gpu-activity.md.
"""
