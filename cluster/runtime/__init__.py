"""One experiment's run: its set-up, the round loop (``Simulation``), the executors and Ray,
interrupts, checkpoints, the checks before any work (preflight), its data store and records."""
