import sys

from rankscope.cli import main

sys.exit(main())
