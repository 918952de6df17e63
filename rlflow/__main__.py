"""`python -m rlflow` is the `rlflow` command."""

import sys

from rlflow.tools.cli import main

sys.exit(main())
