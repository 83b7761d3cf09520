"""`python3 -m expcache_bench`: the expcache command."""

import sys

from .cli import main

sys.exit(main())
