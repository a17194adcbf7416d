#!/bin/sh
# Make the ledger's application roles (docs/security.md, "Compose: least privilege"): compilesvc_api for
# the API and the relay, compilesvc_worker for the workers. Both may only log in; what they may touch is
# granted by `compilesvc migrate --grant-api compilesvc_api --grant-worker compilesvc_worker` (the compose
# migrate job), after every upgrade. The owner (POSTGRES_USER) runs migrations only.
#
# Mounted into postgres's /docker-entrypoint-initdb.d, which runs it on a new data volume. On an existing
# volume run it once by hand: docker compose exec postgres sh /docker-entrypoint-initdb.d/10-compilesvc-roles.sh
# Idempotent: an existing role gets its password set again (so changing it in .env and rerunning works).
#
#   POSTGRES_API_PASSWORD, POSTGRES_WORKER_PASSWORD   the two passwords (required)
#   COMPILESVC_API_ROLE, COMPILESVC_WORKER_ROLE        the names (default compilesvc_api, compilesvc_worker)
#   POSTGRES_USER, POSTGRES_DB                         who runs this, and where (the image's own variables)
set -eu

: "${POSTGRES_API_PASSWORD:?POSTGRES_API_PASSWORD must be set}"
: "${POSTGRES_WORKER_PASSWORD:?POSTGRES_WORKER_PASSWORD must be set}"
API_ROLE="${COMPILESVC_API_ROLE:-compilesvc_api}"
WORKER_ROLE="${COMPILESVC_WORKER_ROLE:-compilesvc_worker}"

# psql's :'name' quotes a value as a literal and :"name" as an identifier: no password or name is ever
# spliced into SQL text here.
#
# No statement needs a superuser, so the same script runs as RDS's (or Aurora's) master user, which holds
# CREATEROLE but is not a superuser: Postgres refuses any SUPERUSER/NOSUPERUSER clause from a non-superuser
# ("must be superuser to alter superuser roles or change superuser attribute", src/backend/commands/user.c,
# AlterRole in 15), so new roles take the defaults (NOSUPERUSER NOCREATEDB NOCREATEROLE, the CREATE ROLE
# reference page) and an existing role has only the attributes it should not have taken away — which fails,
# rightly, when a non-superuser meets a superuser role of that name. One transaction (--single-transaction):
# a failure leaves no role behind without its password.
psql -v ON_ERROR_STOP=1 --no-psqlrc --single-transaction --username "${POSTGRES_USER:-postgres}" \
  --dbname "${POSTGRES_DB:-postgres}" \
  -v api_role="$API_ROLE" -v worker_role="$WORKER_ROLE" \
  -v api_password="$POSTGRES_API_PASSWORD" -v worker_password="$POSTGRES_WORKER_PASSWORD" <<'SQL'
SELECT format('CREATE ROLE %I LOGIN', :'api_role') WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'api_role')
\gexec
SELECT format('CREATE ROLE %I LOGIN', :'worker_role') WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'worker_role')
\gexec
SELECT format('ALTER ROLE %I WITH NOSUPERUSER', rolname) FROM pg_roles
 WHERE rolname IN (:'api_role', :'worker_role') AND rolsuper
\gexec
SELECT format('ALTER ROLE %I WITH NOCREATEDB NOCREATEROLE', rolname) FROM pg_roles
 WHERE rolname IN (:'api_role', :'worker_role') AND (rolcreatedb OR rolcreaterole)
\gexec
ALTER ROLE :"api_role" WITH LOGIN PASSWORD :'api_password';
ALTER ROLE :"worker_role" WITH LOGIN PASSWORD :'worker_password';
SQL
