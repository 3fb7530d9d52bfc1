"""python -m serve EXPORT_DIR [--tokens K | --schedule 1-2:3,3-16:1] [--port 8000]: serve.cli."""

import sys

from serve.cli import main

sys.exit(main())
