"""The ledger's schema migrations (Alembic): ``env.py`` and the revisions in ``versions/``.

Run them with ``ledger.migrate`` (``ledgerflow db upgrade``); no ``alembic.ini`` is needed, the configuration
is built in code (``ledger.migrate.config``).

A schema change is a new revision, never an edit of one already released: change ``ledger/schema.py``, then
let Alembic draft the revision against a database at the current head, read it, and set ``HEAD`` in
``ledger/migrate.py`` to it (``tests/ledger/test_migrations.py`` fails until metadata, revisions and HEAD
agree)::

    from alembic import command
    from ledger.migrate import config
    command.revision(config("postgresql+psycopg://..."), "what changed", autogenerate=True, rev_id="0002")

Triggers, functions and expression indexes are not seen by autogenerate: write those with ``op.execute``.
"""
