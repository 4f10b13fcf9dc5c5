"""`python -m concordia.demo reference|worker|resume ...`: the demo's children."""

import sys

from .run import main

sys.exit(main())
