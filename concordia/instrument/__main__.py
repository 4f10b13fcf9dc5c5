"""`python -m concordia.instrument`: rewrite one PTX module from stdin to stdout
(the LD_PRELOAD shim runs this; see `concordia.instrument.rewriter.main`)."""

import sys

from concordia.instrument.rewriter import main

sys.exit(main())
