"""``python -m elasticd.cli``: the ``elasticd`` command without an installed entry point."""

import sys

from elasticd.cli import main

sys.exit(main())
