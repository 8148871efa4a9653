"""`python -m attnflow.cli ...`: the `attnflow` command."""

import sys

from attnflow.cli import main

sys.exit(main())
