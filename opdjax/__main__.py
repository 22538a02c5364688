"""`python -m opdjax ...` is the `opdjax` command."""

import sys

from opdjax.cli.main import main

sys.exit(main())
