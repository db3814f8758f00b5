"""Secrets kept off the terminal and the job logs: a URI's credentials, masked in every message
that may show one (``ConfigError``, ``TrackingError``, the lines a command prints)."""

from __future__ import annotations

import re

# A URI up to the last "@" of its token (whitespace and quotes end a token): its user
# information. Taken to the last "@", not the first "/": an AWS secret key holds "/" and
# "+", and a password may hold a raw "@", as users paste them unescaped.
# Where a user part without a password may be a token (https://TOKEN@host).
TOKEN_SCHEMES = ("http", "https", "s3")
_USERINFO = re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.-]*://)([^\s'\"]*)@")


def redact_credentials(text: str) -> str:
    """``text`` with the secret of every URI's user information masked: a password
    (``postgresql://mlflow:***@db/mlflow``), or, for HTTP and S3, a user part without one,
    which may be a token (``https://***@host``; a database's user name alone is kept). For
    what reaches a terminal or a job's logs; a URI whose path holds an "@" is masked too
    (better too much than a secret)."""

    def mask(match: re.Match) -> str:
        scheme, userinfo = match.groups()
        user, colon, _ = userinfo.partition(":")
        if colon and "/" not in user:
            return f"{scheme}{user}:***@"
        name = scheme.removesuffix("://").split("+")[0].lower()
        if not colon and "/" not in user and name not in TOKEN_SCHEMES:
            return match.group(0)  # a database's user name alone: its password is elsewhere
        return f"{scheme}***@"

    return _USERINFO.sub(mask, text)
