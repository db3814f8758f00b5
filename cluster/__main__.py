"""``python -m cluster``: the command line (:mod:`cluster.cli.main`)."""

import os
import sys

from cluster.cli.main import main


def run() -> None:
    """Run the command line and exit with its code."""
    code = main()
    if code in (130, 143):  # ended by a signal: a round it dropped may still run on host threads,
        sys.stdout.flush()  # which the interpreter's exit would wait for; all was written already
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":  # importing the module (the API reference does) runs nothing
    run()
