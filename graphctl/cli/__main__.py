import sys

from graphctl.cli import main

sys.exit(main())
