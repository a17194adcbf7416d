#!/bin/sh
# Write Redis's ACL file for compilesvc: one user per service, each allowed the commands that service's
# Celery/kombu (and the API's rate limiter) send, on the keys they send them to, and nothing else
# (docs/security.md, "Compose: least privilege"). The `default` user is off: a connection that does not
# log in as one of these can run nothing.
#
#   sh docker/redis/users.sh OUT.acl
#
# From the environment (docker-compose.yml passes them to the redis service only):
#   REDIS_PASSWORD               admin: every command, for operators (`redis-cli --user admin`); no
#                                compilesvc service holds it
#   REDIS_API_PASSWORD           api
#   REDIS_RELAY_PASSWORD         relay
#   REDIS_WORKER_PASSWORD        worker-cpu, worker-neuron
#   REDIS_HEALTHCHECK_PASSWORD   the container's healthcheck (start.sh makes one up at every start)
#   ALLOW_PLACEHOLDER_SECRETS    true: accept change-me passwords (a development stack only; compose
#                                sets it from COMPILESVC_ALLOW_PLACEHOLDER_SECRETS)
# The file holds only the passwords' SHA-256 (Redis's `#<hash>` form), never the passwords.
#
# What each user sends (kombu's redis transport and redis-py, as pinned; observed with MONITOR and proved
# by tests/deploy/test_redis_users.py and tests/workers/test_least_privilege_e2e.py):
#   every one     PING (kombu checks each new channel), MULTI/EXEC (kombu's pipelines are transactions)
#   publishing    declaring a compile queue: LLEN of its lists (a priority's list is <queue>\x06\x16<n>,
#   (all three)   which compile.* covers), SADD to _kombu.binding.<queue> and _kombu.binding_permanent.<queue>;
#                 the message: LPUSH to the queue. Celery publishes to the default exchange, so no binding
#                 is ever read back.
#   api           the submit rate limiter (`limits`, web/server/ratelimit.py): its Lua scripts (SCRIPT LOAD,
#                 EVALSHA), whose GET/PTTL/EXISTS/SET/INCRBY/RENAME Redis checks against these rules too,
#                 on compilesvc-limits:* only
#   relay         the reconciler (compilesvc/compiles/reconcile.py): LRANGE of the queues, HGETALL unacked, ZRANGE
#                 unacked_index; read only
#   worker        consuming: BRPOP on the queues (declared as above); delivered-but-unacked messages in the
#                 `unacked` hash and `unacked_index` sorted set (HSET/ZADD, ack HDEL/ZREM); handing them
#                 back (a requeue, a shutdown, kombu's visibility-timeout restore): WATCH unacked, HGET, then
#                 LPUSH/RPUSH to the queue, UNWATCH; the restore's lock `unacked_mutex` (redis-py's Lock:
#                 SET NX PX, a Lua release: SCRIPT LOAD, EVALSHA, GET, DEL). Remote control and event
#                 heartbeats are off in the workers (workers/celery_app.py), so no pub/sub at all.
# CLIENT SETINFO (redis-py names itself on connecting, Redis >= 7.2) is refused; redis-py ignores that.
# Nobody but admin may FLUSHALL, CONFIG, ACL, KEYS, SCAN, DEBUG, MODULE, SUBSCRIBE, PUBLISH, DEL...
# These rules assume no COMPILESVC_BROKER_KEY_PREFIX (compose's Redis is compilesvc's alone).
set -eu

OUT="${1:?usage: users.sh OUT.acl}"

check() {  # name password: it goes into the broker URL unencoded, and must not be a placeholder
  if [ -z "$2" ]; then
    echo "$1 must be set" >&2
    exit 2
  fi
  case "$2" in
    *[!A-Za-z0-9._~-]*) echo "$1 may only use A-Z a-z 0-9 . _ ~ - (it is part of a URL)" >&2; exit 2 ;;
  esac
  case "$(printf '%s' "$2" | tr 'A-Z' 'a-z')" in
    *change-me* | *changeme* | *change_me*)
      if [ "${ALLOW_PLACEHOLDER_SECRETS:-false}" != "true" ]; then
        echo "$1 still holds a placeholder ('change-me'): set a real password (docs/deploy.md, \"Secrets\")," \
          "or COMPILESVC_ALLOW_PLACEHOLDER_SECRETS=true for a development stack" >&2
        exit 2
      fi ;;
  esac
}

for variable in REDIS_PASSWORD REDIS_API_PASSWORD REDIS_RELAY_PASSWORD REDIS_WORKER_PASSWORD \
  REDIS_HEALTHCHECK_PASSWORD; do
  eval "check $variable \"\${$variable:-}\""
done

user() {  # name variable rules...
  eval "password=\${$2}"
  hash="$(printf '%s' "$password" | sha256sum | cut -d ' ' -f 1)"
  name="$1"
  shift 2
  echo "user $name on #$hash resetkeys resetchannels -@all $*"
}

QUEUES='~compile.*'
BINDINGS='~_kombu.binding.compile.* ~_kombu.binding_permanent.compile.*'
PUBLISH="+ping +multi +exec (+sadd $BINDINGS) (+llen +lpush $QUEUES)"

umask 077
{
  echo "user default off resetpass resetkeys resetchannels -@all"
  user admin REDIS_PASSWORD '+@all ~* &*'
  user api REDIS_API_PASSWORD "$PUBLISH" \
    '+script|load (+evalsha +get +pttl +exists +set +incrby +rename ~compilesvc-limits:*)'
  user relay REDIS_RELAY_PASSWORD "$PUBLISH" "(+lrange $QUEUES) (+hgetall ~unacked) (+zrange ~unacked_index)"
  user worker REDIS_WORKER_PASSWORD "$PUBLISH" "+unwatch +script|load (+brpop +rpush $QUEUES)" \
    '(+watch +hset +hget +hdel ~unacked) (+zadd +zrem +zrange ~unacked_index)' \
    '(+set +get +del +evalsha ~unacked_mutex)'
  user healthcheck REDIS_HEALTHCHECK_PASSWORD '+ping'
} > "$OUT.tmp"
mv "$OUT.tmp" "$OUT"
