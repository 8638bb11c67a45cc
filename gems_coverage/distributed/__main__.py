"""`python -m gems_coverage.distributed` (what torchrun runs on every rank)."""
import sys

from .launch import main

sys.exit(main())
