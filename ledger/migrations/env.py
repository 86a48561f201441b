"""Alembic's environment for the ledger, run by Alembic's commands (``ledger.migrate`` calls them).

``ledger.migrate.upgrade`` passes its own connection (``config.attributes["connection"]``), already inside
the transaction that holds the schema lock, so the migrations, the version row and the lock commit together.
Without one (drafting a revision), the URL comes from the config's ``sqlalchemy.url``.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, create_engine, pool

from ledger.migrate import include_name
from ledger.schema import metadata

config = context.config


def run(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=metadata, include_name=include_name)
    # Postgres DDL is transactional: all pending revisions and the version row commit at once, or none.
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():  # `--sql`: print the DDL for a person to run
    context.configure(dialect_name="postgresql", target_metadata=metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    given = config.attributes.get("connection")
    if isinstance(given, Connection):
        run(given)
    else:
        engine = create_engine(config.get_main_option("sqlalchemy.url", ""), poolclass=pool.NullPool)
        try:
            with engine.connect() as connection:
                run(connection)
        finally:
            engine.dispose()
