import sys

from atom_runtime.cli import main

sys.exit(main())
