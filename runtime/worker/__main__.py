"""``python -m gpu_trace.runtime.worker``: a worker process of ``gpu-trace serve`` (the front
starts it; see :mod:`gpu_trace.runtime.worker.process`)."""

import sys

from gpu_trace.runtime.worker.process import main

sys.exit(main())
