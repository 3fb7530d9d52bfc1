"""python -m serve EXPORT_DIR [--tokens K | --schedule 1-2:3,3-16:1] [--port 8000]: serve.server."""

import sys

from serve.server import main

sys.exit(main())
