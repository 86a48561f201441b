"""Driver errors as ledger errors: the one place the ledger reads what a database driver raised.

Every statement of the ledger runs inside ``translated()`` (the recorder and its stores, ``ledger.migrate``,
``ledger.reports``), so no caller ever handles a psycopg or SQLAlchemy exception. The classification reads
only what SQLAlchemy gives for every DBAPI driver (its exception classes, ``connection_invalidated``) and what
the server itself sent (a SQLSTATE, a constraint's name), so it holds whichever Postgres driver is installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

from sqlalchemy import exc as sa_exc

from ledger.errors import LedgerError, LedgerUnavailable

# The SQLSTATE of a missing table: the only server error the ledger expects and reads (a schema check on a
# database that has none yet).
_UNDEFINED_TABLE: Final = "42P01"


@contextmanager
def translated() -> Iterator[None]:
    """Translate driver errors into ledger errors, ``from`` the driver's; our own errors pass through."""
    try:
        yield
    except LedgerError:
        raise
    except (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError) as e:
        raise LedgerUnavailable(f"ledger database unavailable: {_describe(e)}") from e
    except sa_exc.DBAPIError as e:
        if e.connection_invalidated:
            raise LedgerUnavailable(f"ledger connection lost: {_describe(e)}") from e
        raise LedgerError(f"ledger database error: {_describe(e)}") from e


def violated(error: BaseException | None) -> str | None:
    """The name of the constraint an integrity error violated, as the server named it; None for any other."""
    if not isinstance(error, sa_exc.IntegrityError):
        return None
    name = getattr(getattr(error.orig, "diag", None), "constraint_name", None)
    return name if isinstance(name, str) else None


def undefined_table(error: sa_exc.DBAPIError) -> bool:
    """Whether the server refused a statement because a table it names does not exist."""
    # psycopg 3 and asyncpg call the code ``sqlstate``, psycopg2 ``pgcode``.
    code = getattr(error.orig, "sqlstate", None) or getattr(error.orig, "pgcode", None)
    return code == _UNDEFINED_TABLE


def _describe(error: sa_exc.SQLAlchemyError) -> str:
    # The driver's message only: SQLAlchemy's own text appends the statement and its parameters (payloads).
    cause = getattr(error, "orig", None) or error
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[0] if lines else ''}"
