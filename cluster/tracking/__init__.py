"""MLflow tracking: the run written by a process of its own, its tracker, and one tracking
server in front of an SQLite store for concurrent runs."""
