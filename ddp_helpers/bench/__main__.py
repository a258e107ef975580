"""`python -m ddp_helpers.bench ...`: the command line (bench/cli.py); bad input is one clear line."""
import sys

from ..gpu_leases import GpusBusy
from .cli import main

try:
    main()
except (ValueError, GpusBusy) as exc:  # bad input, or the GPUs held by others: one clear line, not a traceback
    sys.exit(f"error: {exc}")
