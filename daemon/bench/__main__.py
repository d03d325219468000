"""``python -m daemon.bench``: the same as ``meshd bench``."""

import sys

from daemon.bench.run import main

sys.exit(main())
