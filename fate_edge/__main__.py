import sys

from fate_edge.apps.cli import main

sys.exit(main())
