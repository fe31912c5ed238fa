"""`python -m luced.cli ...`: the `luced` command."""

import sys

from luced.cli import main

if __name__ == "__main__":  # not when merely imported (tests/test_layering.py imports all)
    sys.exit(main())
