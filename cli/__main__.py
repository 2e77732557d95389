import sys

from ringq.cli import main

sys.exit(main())
