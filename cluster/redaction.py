"""Secrets kept off the terminal and the job logs: a URI's credentials, masked in every message
that may show one (``ConfigError``, ``TrackingError``, the lines a finished run prints)."""

from __future__ import annotations

import re

# The user information of a URI (``scheme://USER:PASSWORD@host`` or ``scheme://TOKEN@host``).
_USERINFO = re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.-]*://)([^\s/@:'\"]*)(:[^\s/@'\"]*)?@")


def redact_credentials(text: str) -> str:
    """``text`` with the secret of every URI's user information masked: a password
    (``postgresql://mlflow:***@db/mlflow``), or a user part without one, which may be a token
    (``https://***@host``). For what reaches a terminal or a job's logs."""

    def mask(match: re.Match) -> str:
        scheme, user, password = match.groups()
        return f"{scheme}{user}:***@" if password is not None else f"{scheme}***@"

    return _USERINFO.sub(mask, text)
