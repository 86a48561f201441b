# The ledger database's first start (the postgres image runs this once, on an empty data directory).
#
# No ledgerflow process ever connects as a superuser. This makes `ledger_owner`, the role that runs the
# migrations and owns the tables and triggers: CREATEROLE (revision 0006 creates the NOLOGIN group roles and
# `ledgerflow db roles` the login users), never SUPERUSER. Then the image's bootstrap superuser loses its
# password: it can no longer log in over the network at all (only through this container's local socket).
# Sourced by the image's entrypoint: no `set` here (it would change the entrypoint's own shell options).
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname postgres \
  --set owner_password="$LEDGER_OWNER_DB_PASSWORD" <<'SQL'
CREATE ROLE ledger_owner LOGIN CREATEROLE NOSUPERUSER NOCREATEDB NOREPLICATION NOBYPASSRLS
  PASSWORD :'owner_password';
ALTER DATABASE ledger OWNER TO ledger_owner;
\connect ledger
ALTER SCHEMA public OWNER TO ledger_owner;
ALTER ROLE CURRENT_USER PASSWORD NULL;
SQL
