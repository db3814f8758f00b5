"""Where runs are tracked and how long an artifact upload may take: the settings the driver
(``cluster.tracking.process.TrackingRun``), the tracking process and its tracker
(``cluster.tracking.tracker``) share. Imports neither MLflow nor torch: the driver checks the
tracking URI before Ray starts."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
# An artifact upload to a tracking server (``mlflow-artifacts:/``) is answered only once the
# server has stored the file at its destination (S3 behind an ``--artifacts-destination
# s3://…``): its first upload also sets up its S3 client (every 4 s try of the partition report
# timed out on a loaded 2-core machine) and a model's lasts as long as the server's own upload.
# Each try of an upload gets ARTIFACT_TIMEOUT_S, unless the user set MLFLOW_HTTP_REQUEST_TIMEOUT
# (that, then) or ARTIFACT_TIMEOUT_VARIABLE; a hung server is given up ≈ 4 min into the upload.
ARTIFACT_TIMEOUT_VARIABLE = "DPFL_MLFLOW_ARTIFACT_TIMEOUT"
ARTIFACT_TIMEOUT_S = "60"


def tracking_uri() -> str:
    """Where runs are tracked: ``$MLFLOW_TRACKING_URI``, else (unset or empty, as MLflow reads
    it) the local SQLite file. Here, in a module that imports neither MLflow nor torch: the
    driver checks it before Ray starts, the tracking process before the driver's run is
    configured."""
    return os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///relative.db`` or ``sqlite:////absolute.db`` URI."""
    prefix = "sqlite:///"
    return Path(uri[len(prefix) :]) if uri.startswith(prefix) else None
