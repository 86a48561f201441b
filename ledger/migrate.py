"""Schema migrations: Alembic, configured in code, its revisions in ``ledger/migrations/versions``.

Only ``upgrade`` runs DDL, and only for a caller that was asked to (``ledgerflow db upgrade``, the embedded
stack, the tests: ``Recorder.create_schema``). Workers and CLI commands call ``check`` when they start: one
query, and a one-line ``SchemaMismatch`` unless the database is at ``HEAD`` (no schema yet, an older revision,
or a revision this ledgerflow does not know: written by a newer one).

A database made by a release before migrations (``ledger_schema_version`` or the ledger's tables, but no
``alembic_version``) is adopted by ``upgrade``: the baseline revision is idempotent, so it adds what that
release lacked and Alembic records it; later revisions then apply as usual.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

from sqlalchemy import Connection, Engine, create_engine, pool, text
from sqlalchemy import exc as sa_exc

from ledger.errors import SchemaMismatch
from ledger.pgerrors import translated, undefined_table

if TYPE_CHECKING:
    from alembic.config import Config

# Alembic is imported only where it is used: loading it costs ~0.1 s, and every start calls check, which
# does not need it while the database is at HEAD.

HEAD: Final = "0012"
"""The revision this ledgerflow needs: the newest in ``ledger/migrations/versions`` (a test checks it)."""

SCRIPTS: Final = Path(__file__).resolve().with_name("migrations")

# The constant the releases before migrations locked while creating their schema ("ledger" in ASCII): an
# upgrade also waits for one of them still running its DDL against this database.
_LOCK_KEY: Final = 0x6C6564676572
_LOCK: Final = text("SELECT pg_advisory_xact_lock(:key)")

_REVISIONS: Final = text("SELECT version_num FROM alembic_version ORDER BY version_num")
_CATALOG: Final = text(
    "SELECT to_regclass('alembic_version') IS NOT NULL, to_regclass('ledger_schema_version') IS NOT NULL,"
    " to_regclass('task_leases') IS NOT NULL"
)
_EARLIER_VERSION: Final = text("SELECT max(version) FROM ledger_schema_version")


@dataclass(frozen=True)
class Found:
    """What a database holds: its Alembic revisions, or the schema of a release before migrations."""

    revisions: tuple[str, ...]
    earlier: str | None = None  # "schema version 4", when there is no revision but an earlier schema

    @property
    def revision(self) -> str | None:
        return ",".join(self.revisions) or None

    def describe(self) -> str:
        if self.revisions:
            return f"revision {self.revision}"
        if self.earlier:
            return f"the schema of a ledgerflow from before migrations ({self.earlier})"
        return "no schema"


@dataclass(frozen=True)
class Upgraded:
    """What ``upgrade`` did: the database's revision before (None: none) and after."""

    before: str | None
    after: str
    adopted: str | None = None  # the earlier release's schema it adopted ("schema version 4")

    def lines(self) -> list[str]:
        """What ``ledgerflow db upgrade`` prints."""
        if self.before == self.after:
            return [f"the ledger database is at revision {self.after} already: nothing to do"]
        if self.adopted is not None:
            return [
                f"adopted the ledger database of a ledgerflow from before migrations ({self.adopted})",
                f"upgraded it to revision {self.after}",
            ]
        if self.before is None:
            return [f"created the ledger schema at revision {self.after}"]
        return [f"upgraded the ledger database from revision {self.before} to {self.after}"]


def config(url: str | None = None) -> Config:
    """Alembic's configuration, built in code (no ``alembic.ini``); ``url`` only for drafting revisions."""
    from alembic.config import Config

    cfg = Config()
    # set_main_option interpolates %-signs (configparser): a path or URL with one must escape it.
    cfg.set_main_option("script_location", str(SCRIPTS).replace("%", "%%"))
    cfg.set_main_option("path_separator", "os")
    if url is not None:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def include_name(name: str | None, type_: str, parent_names: object) -> bool:
    """What autogenerate compares: everything but the version marker of the releases before migrations."""
    # ledger_schema_version stays for those releases (see the baseline revision); the metadata lacks it.
    return not (type_ == "table" and name == "ledger_schema_version")


def check(target: Engine | str) -> None:
    """Refuse to go on unless the database is at ``HEAD``: one query, no DDL.

    Raises:
        SchemaMismatch: no schema, an older revision, or a newer one; its message says what to run.
        LedgerUnavailable: the database cannot be reached.
    """
    _verdict(_found(target))


def current(target: Engine | str) -> str | None:
    """The database's revision (several joined by commas); None: no schema, or one from before migrations."""
    return _found(target).revision


def upgrade(target: Engine | str) -> Upgraded:
    """Bring the database to ``HEAD``: idempotent, safe to race, one transaction.

    Raises:
        SchemaMismatch: the database is at a revision this ledgerflow does not know (nothing was changed).
    """
    from alembic import command

    with translated(), _engine(target) as engine:
        found = _found(engine)
        if found.revisions == (HEAD,):  # every start of the stack and of each test session: no lock, no DDL
            return Upgraded(HEAD, HEAD)
        # The lock and the DDL need a real transaction, whatever the engine's own isolation level.
        with engine.execution_options(isolation_level="READ COMMITTED").begin() as conn:
            # Serializes concurrent upgrades (and CREATE TABLE/REPLACE FUNCTION races): the second waits here
            # and then finds the first one's work committed. Transaction-scoped: released at commit, with the
            # DDL and the version row (Postgres DDL is transactional).
            conn.execute(_LOCK, {"key": _LOCK_KEY})
            found = _read_catalog(conn)
            if found.revisions != (HEAD,):
                _refuse_unknown(found)
                cfg = config()
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, "head")
    return Upgraded(found.revision, HEAD, None if found.revisions else found.earlier)


def upgrade_lines(url: str) -> list[str]:
    """``ledgerflow db upgrade``: upgrade, and say what was done (raises as ``upgrade``)."""
    return upgrade(url).lines()


def current_lines(url: str) -> list[str]:
    """``ledgerflow db current``: the database's revision, this ledgerflow's, and what to do if they differ.

    Never raises SchemaMismatch (the last line carries its message); call ``check`` for an exit status.
    """
    found = _found(url)
    lines = [f"ledger database: {found.describe()}", f"this ledgerflow: revision {HEAD}"]
    try:
        _verdict(found)
    except SchemaMismatch as e:
        return [*lines, str(e)]
    return [*lines, "up to date"]


def known_revisions() -> list[str]:
    """Every revision in ``ledger/migrations/versions``, newest first."""
    from alembic.script import ScriptDirectory

    scripts = ScriptDirectory(str(SCRIPTS))
    return [s.revision for s in scripts.walk_revisions()]


def heads() -> list[str]:
    """The newest revisions of the scripts (one, unless the history branched): ``HEAD`` must be that one."""
    from alembic.script import ScriptDirectory

    return list(ScriptDirectory(str(SCRIPTS)).get_heads())


def _found(target: Engine | str) -> Found:
    with translated(), _engine(target) as engine, engine.connect() as conn:
        # One statement, atomic on its own: AUTOCOMMIT saves the BEGIN and ROLLBACK round trips.
        return _read(conn.execution_options(isolation_level="AUTOCOMMIT"))


def _verdict(found: Found) -> None:
    if found.revisions == (HEAD,):
        return
    if not found.revisions:
        raise SchemaMismatch(None, HEAD, earlier=found.earlier)
    _refuse_unknown(found)
    raise SchemaMismatch(found.revision, HEAD)


def _refuse_unknown(found: Found) -> None:
    """A revision the scripts do not have was written by a newer ledgerflow: refuse, change nothing."""
    if set(found.revisions) - set(known_revisions()):
        raise SchemaMismatch(found.revision, HEAD, newer=True)


def _read(conn: Connection) -> Found:
    """What the database holds, in one query when it has a revision (every worker and CLI start)."""
    try:
        return Found(tuple(conn.execute(_REVISIONS).scalars()))
    except sa_exc.ProgrammingError as e:
        if not undefined_table(e):
            raise
    conn.rollback()  # without AUTOCOMMIT, the failed statement aborted the implicit transaction
    return _read_catalog(conn)


def _read_catalog(conn: Connection) -> Found:
    """What the database holds, asking the catalog first (no error, so usable inside a transaction)."""
    has_revisions, has_earlier_version, has_tables = conn.execute(_CATALOG).one()
    if has_revisions:
        return Found(tuple(conn.execute(_REVISIONS).scalars()))
    if has_earlier_version:
        return Found((), f"schema version {conn.execute(_EARLIER_VERSION).scalar()}")
    if has_tables:  # the first release kept no version
        return Found((), "no schema version")
    return Found(())


@contextmanager
def _engine(target: Engine | str) -> Iterator[Engine]:
    """``target`` if it is an engine (its pool is reused); else a one-connection engine, disposed after."""
    if isinstance(target, Engine):
        yield target
        return
    engine = create_engine(target, poolclass=pool.NullPool)
    try:
        yield engine
    finally:
        engine.dispose()
