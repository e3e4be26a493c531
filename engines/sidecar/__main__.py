"""``python -m kvloop.engines.sidecar``: what the engine launcher starts beside each engine."""

import sys

from kvloop.engines.sidecar import main

sys.exit(main())
