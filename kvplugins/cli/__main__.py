import sys

from kvplugins.cli import main

sys.exit(main())
