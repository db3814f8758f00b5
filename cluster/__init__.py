"""Driver side: config, the Simulation round loop, executors, tracking, CLI (knows Ray/MLflow)."""
