"""User-facing errors.

Everything a user can get wrong (a preset name, a divisibility rule, a malformed file, a
model that cannot fit) raises a subclass of :class:`StparError`. The CLI and the launch
script print its message on one line and exit non-zero with no traceback; library callers
catch it like any exception.
"""

from __future__ import annotations


class StparError(Exception):
    """A problem with the user's input. ``exit_code`` is what the CLI exits with."""

    exit_code = 2


class ConfigError(StparError):
    """Bad or inconsistent configuration: unknown preset, broken divisibility rule, bad JSON."""


class DoesNotFitError(StparError):
    """No layout fits in memory; the message names the closest one and what would help."""


class DataError(StparError):
    """A dataset path that is missing, empty or has no usable column."""
