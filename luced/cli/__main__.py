"""`python -m luced.cli ...`: the `luced` command."""

import sys

from luced.cli import main

sys.exit(main())
