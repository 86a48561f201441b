"""The CLI's user-facing errors, in a module that imports nothing: ``ledgerflow.cli`` names them when it is
imported, and ``ledgerflow --help`` must not pay for Temporal's or SQLAlchemy's imports."""

from __future__ import annotations


class ClientError(Exception):
    """A task could not be started or found (a user-facing, one-line error)."""


class StackError(Exception):
    """The embedded stack could not be started (a user-facing, one-line error)."""
