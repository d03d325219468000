"""``python -m meshtui``: the same as the ``meshtui`` command."""

import sys

from meshtui.cli import main

sys.exit(main())
