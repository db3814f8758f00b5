"""Privacy accounting (no Ray, no MLflow): accountants, calibration, budgets."""
