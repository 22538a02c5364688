import sys

from opdjax.cli.main import main

sys.exit(main())
