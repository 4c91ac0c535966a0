import sys

from rlcore.launch.cli import main

sys.exit(main())
