"""Driver side: config, the Simulation round loop, executors, tracking, CLI (knows Ray/MLflow)."""

import os

# Under `uv run`, Ray (≥ 2.44) would package the working directory and build a fresh virtual
# environment for every worker of a *local* Ray (16 s of a 24 s quickstart here); the workers
# of an embedded or job-launched Ray already run this environment. Read when Ray is imported.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
