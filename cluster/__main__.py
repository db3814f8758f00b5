import os
import sys

from cluster.cli.main import main

code = main()
if code in (130, 143):  # ended by a signal: a round it dropped may still run on host threads,
    sys.stdout.flush()  # which the interpreter's exit would wait for; all was written already
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
