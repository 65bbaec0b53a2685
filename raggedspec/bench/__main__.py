"""`python -m raggedspec.bench`: the benchmark's command line (`raggedspec.bench.runner`)."""

import sys

from raggedspec.bench.runner import main

sys.exit(main())
