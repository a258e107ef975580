"""`python -m ddp_helpers.bench ...`: the command line (bench/cli.py); bad input is one clear line."""
import sys

from .cli import main

try:
    main()
except ValueError as exc:  # bad input: one clear line, not a traceback
    sys.exit(f"error: {exc}")
