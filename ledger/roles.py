"""The ledger database's login users: ``ledgerflow db roles``.

Revision 0006 (``ledger/migrations/versions/0006_roles.py``) creates three NOLOGIN group roles and grants
each what its processes do: ``ledgerflow_worker``, ``ledgerflow_operator``, ``ledgerflow_reader``; revision
0010 a fourth, ``ledgerflow_receiver`` (the webhook receiver: it inserts vendor callbacks and nothing else).
People and processes log in as users that are *members* of one of them. This module creates or updates
those users, each with its password from the environment of the one running it (never from a command line,
where ``ps`` would show it):

====================================  ==================  =======================
password from                         login user          member of
====================================  ==================  =======================
``LEDGERFLOW_DB_WORKER_PASSWORD``     ``lf_worker``       ``ledgerflow_worker``
``LEDGERFLOW_DB_OPERATOR_PASSWORD``   ``lf_operator``     ``ledgerflow_operator``
``LEDGERFLOW_DB_READER_PASSWORD``     ``lf_reader``       ``ledgerflow_reader``
``LEDGERFLOW_DB_RECEIVER_PASSWORD``   ``lf_receiver``     ``ledgerflow_receiver``
====================================  ==================  =======================

Why a command rather than passwords in the migration: a revision is frozen and stored in the repository, so
it must hold no secret; the roles' grants are schema (versioned, the same everywhere), the logins and their
passwords are a deployment's (rotated by running the command again, with no new revision). It runs as the
owner (the role that ran the migrations: CREATEROLE, which since PostgreSQL 16 administers the roles it
created) — never as a superuser. The password is hashed here (SCRAM-SHA-256, by libpq), so the server and its
statement log only ever see the hash.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from sqlalchemy import create_engine, pool, text

from ledger.errors import LedgerError
from ledger.pgerrors import translated

GROUPS: Final = {
    "worker": "ledgerflow_worker",
    "operator": "ledgerflow_operator",
    "reader": "ledgerflow_reader",
    "receiver": "ledgerflow_receiver",
}
USERS: Final = {kind: f"lf_{kind}" for kind in GROUPS}
ENV: Final = {kind: f"LEDGERFLOW_DB_{kind.upper()}_PASSWORD" for kind in GROUPS}
MIN_PASSWORD: Final = 16

_EXISTS: Final = text("SELECT rolsuper FROM pg_roles WHERE rolname = :name")
_GROUP_EXISTS: Final = text("SELECT 1 FROM pg_roles WHERE rolname = :name")
# Nothing a login user may do beyond its group's grants: no superuser, no roles, no databases, no bypass of
# row security, no replication (which bypasses triggers).
_ATTRIBUTES: Final = "LOGIN INHERIT NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS"


@dataclass(frozen=True)
class Login:
    kind: str
    user: str
    group: str
    created: bool

    @property
    def line(self) -> str:
        done = "created" if self.created else "password and membership updated"
        return f"{self.user}: {done} (member of {self.group} only)"


def ensure_logins(url: str, env: Mapping[str, str]) -> list[Login]:
    """Create or update the login user of every group whose password ``env`` holds; what was done.

    Raises:
        LedgerError: no password given, one too short, a group role missing (run ``ledgerflow db upgrade``
            first), or the server refused (the one running it is not the owner); one line each.
    """
    wanted = {kind: env[name] for kind, name in ENV.items() if env.get(name)}
    if not wanted:
        raise LedgerError(f"no password given: set one or more of {', '.join(ENV.values())}")
    for kind, password in wanted.items():
        if len(password) < MIN_PASSWORD:
            raise LedgerError(f"{ENV[kind]} is shorter than {MIN_PASSWORD} characters")
    engine = create_engine(url, poolclass=pool.NullPool)
    done: list[Login] = []
    try:
        with translated(), engine.begin() as conn:
            raw = conn.connection.dbapi_connection
            pgconn = getattr(raw, "pgconn", None)
            if pgconn is None:
                raise LedgerError("ledgerflow db roles needs the psycopg 3 driver (postgresql+psycopg://)")
            for kind, password in wanted.items():
                user, group = USERS[kind], GROUPS[kind]
                if conn.execute(_GROUP_EXISTS, {"name": group}).first() is None:
                    raise LedgerError(f"role {group} does not exist: run `ledgerflow db upgrade` first")
                found = conn.execute(_EXISTS, {"name": user}).first()
                if found is not None and found[0]:
                    raise LedgerError(f"{user} exists and is a superuser: refusing to touch it")
                hashed = pgconn.encrypt_password(password.encode(), user.encode(), b"scram-sha-256").decode()
                # A quoted literal (a SCRAM verifier holds no quote; doubled anyway), its colons escaped from
                # SQLAlchemy's bind-parameter syntax.
                literal = ("'" + hashed.replace("'", "''") + "'").replace(":", "\\:")
                verb = "CREATE" if found is None else "ALTER"
                conn.execute(text(f"{verb} ROLE {user} {_ATTRIBUTES} PASSWORD {literal}"))
                # Exactly one group: drop any other membership a past run (or a person) gave it (a group an
                # older schema lacks cannot be one).
                for other in GROUPS.values():
                    if other != group and conn.execute(_GROUP_EXISTS, {"name": other}).first() is not None:
                        conn.execute(text(f"REVOKE {other} FROM {user}"))
                conn.execute(text(f"GRANT {group} TO {user}"))
                done.append(Login(kind, user, group, created=found is None))
    finally:
        engine.dispose()
    return done
