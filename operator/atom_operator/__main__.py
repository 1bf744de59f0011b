"""`python -m atom_operator ...` is `atom operator ...` (e.g. `python -m atom_operator run`)."""

from __future__ import annotations

import sys

from atom_runtime.cli import main

if __name__ == "__main__":
    sys.exit(main(["operator", *sys.argv[1:]]))
