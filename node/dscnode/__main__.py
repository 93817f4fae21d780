"""The command line (cli.py): `python3 -m dscnode ACTION ...` with node/ on the import path, and the
built file's own entry point (build.py puts this file at its top, where python3 looks for it)."""
import sys

from dscnode.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
