"""Locations a config names that an environment variable may override (``$DPFL_*``): local
paths, or, where the field allows it, object-store URIs (``s3://bucket/prefix``,
``datasets.locations``)."""

from __future__ import annotations

import os

from cluster.config.errors import ConfigError
from datasets.locations import Location, LocationError, ObjectLocation, parse_location


def configured_path(field: str, variable: str, value: str, object_store: bool = False) -> Location:
    """``$variable`` if set and not empty (an empty one is unset, as an empty
    ``MLFLOW_TRACKING_URI`` is: never the working directory), else ``value`` (the config's
    ``field``), ``$VARS`` expanded: an
    ``ObjectLocation`` for a URI where the field takes one (``object_store``), else a ``Path``
    with ``~`` expanded, not resolved (a relative path stays relative: where it resolves is the
    caller's decision). A malformed URI, a URI where only a local path will do, or a ``~user``
    naming no user is a ``ConfigError`` naming where the value came from."""
    source, text = (variable, os.environ[variable]) if os.environ.get(variable) else (field, value)
    try:
        location = parse_location(os.path.expandvars(text))
    except LocationError as error:
        raise ConfigError(source, text, error.problem) from None
    if isinstance(location, ObjectLocation):
        if not object_store:
            raise ConfigError(
                source, text, "must be a directory on this machine, not an object-store URI"
            )
        return location
    try:
        return location.expanduser()
    except RuntimeError as error:  # pathlib: no home directory for that ~user
        raise ConfigError(
            source, text, f"{error} ({text.split('/')[0]}); write the path without ~"
        ) from None


def resolved_path(field: str, variable: str, value: str, object_store: bool = False) -> Location:
    """``configured_path``, resolved (``resolve``)."""
    return resolve(field, configured_path(field, variable, value, object_store))


def resolve(field: str, path: Location) -> Location:
    """A local ``path`` made absolute with symlinks resolved (a symlink loop is a
    ``ConfigError``); an object location checked (it may have been joined with a relative
    path since it was parsed: a ``..`` or empty segment is a ``ConfigError``)."""
    if isinstance(path, ObjectLocation):
        try:
            path.check()
        except LocationError as error:
            raise ConfigError(field, str(path), error.problem) from None
        return path
    try:
        return path.resolve()
    except RuntimeError as error:  # pathlib: a symlink loop
        raise ConfigError(field, str(path), f"{error}; point it at a real directory") from None


def location_error(field: str, value: str, error: LocationError) -> ConfigError:
    """The ``ConfigError`` of a location ``field`` = ``value`` that ``error`` refused: naming
    the environment variable at fault (a credential, the endpoint) where it is one."""
    if error.variable is not None:
        return ConfigError(error.variable, error.value, f"{error.problem} (for {field} {value})")
    return ConfigError(field, value, error.problem)
