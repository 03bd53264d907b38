"""`python -m gpu_trace` runs the CLI."""

import sys

from gpu_trace.cli import main

sys.exit(main())
