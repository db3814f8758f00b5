"""Data sources, partitioners, the Arrow shard store and tasks (no Ray, no MLflow)."""
