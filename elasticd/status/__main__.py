"""``python -m elasticd.status [flags]``: `elasticd status` without the other subcommands."""

import sys

from elasticd.status.cli import main

sys.exit(main())
