"""`python3 -m pyexpcache`: deprecated, kept for one release. The command line is the benchmark
suite's (`expcache`, or `python3 -m expcache_bench`); this forwards to it with a DeprecationWarning.
Only running this module imports the suite: `import pyexpcache` never does."""

import sys
import warnings

from expcache_bench import cli

cli.show_warnings()
warnings.warn(
    "'python3 -m pyexpcache' is deprecated and goes in the next release: run 'expcache' or "
    "'python3 -m expcache_bench' with the same arguments",
    DeprecationWarning,
    stacklevel=1,
)
sys.exit(cli.main())
