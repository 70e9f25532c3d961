"""`python -m art ...` runs the `art` command."""

import sys

from art.cli import main

sys.exit(main())
