"""``python -m dsv4_tl.tune`` = ``dsv4-tl tune``."""

import sys

from .cli import main

sys.exit(main())
