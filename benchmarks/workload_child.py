"""One timed variant of ``benchmarks.workloads`` in a fresh interpreter, started as the CLI
starts: a project variant starts its MLflow tracking process before importing torch
(``cluster.cli.run``), the plain loop does not track. Run by ``workloads.timed_in_child``::

    python -m benchmarks.workload_child --child VARIANT --workloads NAME [--set KEY=VALUE ...]
"""

import sys

from cluster.tracking.process import prestart

if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[argv.index("--child") + 1] != "plain":
        prestart()
    from benchmarks.workloads import main

    sys.exit(main(argv))
