"""``python -m gpu_trace.collectors.nvml record FILE``: record NVML readings to replay without a GPU
(see ``replay.py``)."""

import sys

from gpu_trace.collectors.nvml.replay import main

sys.exit(main(sys.argv[1:]))
