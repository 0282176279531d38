"""``python -m numa_engram`` runs the numa-engram command."""

import sys

from .cli import main

sys.exit(main())
