import sys

from kvpipe.cli import main

sys.exit(main())
