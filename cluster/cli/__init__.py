"""``python -m cluster``: the dispatcher (``main``) and one module per subcommand, each imported
only when its subcommand is chosen."""
