"""`python -m vlite ...`: the same as the `vlite` command."""

import sys

from vlite.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
