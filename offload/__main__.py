"""`python -m offload` works like `offload`."""

import sys

from offload.cli.main import main

sys.exit(main())
