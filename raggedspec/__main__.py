"""`python -m raggedspec ...` is the same as the `raggedspec` console script."""

import sys

from raggedspec.cli import main

sys.exit(main())
