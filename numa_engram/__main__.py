"""``python -m numa_engram`` runs the numa-engram command."""

import sys

from .cli.app import main

sys.exit(main())
