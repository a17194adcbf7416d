#!/bin/sh
# Start Redis for compilesvc: write its ACL file (users.sh: one user per service, `default` off) from the
# REDIS_*_PASSWORD variables, then hand over to the redis image's own entrypoint with compose's command.
#
# The users are written at every start, so the only copy of the passwords is the environment
# (docker-compose.yml takes them from .env); nothing secret lives in the repo. The healthcheck's user gets a
# password made up here, kept in a file only root (the healthcheck) reads.
# Bind-mounted read-only into the redis image by docker-compose.yml; also runs outside Docker
# (REDIS_CONFIG_DIR=/tmp/x sh docker/redis/start.sh redis-server --port 6380, with redis-server on PATH).
set -eu

CONFIG_DIR="${REDIS_CONFIG_DIR:-/run/compilesvc-redis}"
ENTRYPOINT="${REDIS_ENTRYPOINT:-docker-entrypoint.sh}"

umask 077
mkdir -p "$CONFIG_DIR"
if [ -z "${REDIS_HEALTHCHECK_PASSWORD:-}" ]; then
  REDIS_HEALTHCHECK_PASSWORD="$(head -c 24 /dev/urandom | od -A n -t x1 | tr -d ' \n')"
fi
printf '%s' "$REDIS_HEALTHCHECK_PASSWORD" > "$CONFIG_DIR/healthcheck-password"
REDIS_HEALTHCHECK_PASSWORD="$REDIS_HEALTHCHECK_PASSWORD" sh "$(dirname "$0")/users.sh" "$CONFIG_DIR/users.acl"

# The image's entrypoint drops to the redis user, which must read the ACL file (and may rewrite it: ACL SAVE).
if [ "$(id -u)" = 0 ] && id redis > /dev/null 2>&1; then
  chown redis "$CONFIG_DIR" "$CONFIG_DIR/users.acl"
fi
# Redis itself needs none of the passwords: its users hold their hashes.
unset REDIS_PASSWORD REDIS_API_PASSWORD REDIS_RELAY_PASSWORD REDIS_WORKER_PASSWORD REDIS_HEALTHCHECK_PASSWORD
exec "$ENTRYPOINT" "$@" --aclfile "$CONFIG_DIR/users.acl"
