import sys

from hetplan.cli import main

sys.exit(main())
