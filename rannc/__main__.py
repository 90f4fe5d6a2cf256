"""`python -m rannc plan ...`: the same as the `rannc` command."""

import sys

from rannc.cli import main

sys.exit(main())
