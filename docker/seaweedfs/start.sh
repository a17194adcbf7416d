#!/bin/sh
# Start SeaweedFS `weed mini` (master, volume, filer and S3 gateway in one process) for compilesvc.
#
# The S3 identity is written from S3_ACCESS_KEY / S3_SECRET_KEY at every start, so the only copy of the
# secret is the environment (docker-compose.yml takes it from .env); nothing secret lives in the repo.
# Bind-mounted read-only into the chrislusf/seaweedfs image by docker-compose.yml; also runs outside
# Docker (WEED=/path/to/weed S3_DATA_DIR=/tmp/x sh docker/seaweedfs/start.sh).
set -eu

: "${S3_ACCESS_KEY:?S3_ACCESS_KEY must be set}"
: "${S3_SECRET_KEY:?S3_SECRET_KEY must be set}"
WEED="${WEED:-weed}"
DATA_DIR="${S3_DATA_DIR:-/data}"
S3_PORT="${S3_PORT:-8333}"
CONFIG_DIR="${S3_CONFIG_DIR:-/tmp/compilesvc-s3}"

# The keys go into JSON unescaped: allow only what AWS-style keys use.
for value in "$S3_ACCESS_KEY" "$S3_SECRET_KEY"; do
  case "$value" in
    *[!A-Za-z0-9/+=._-]*) echo "S3_ACCESS_KEY/S3_SECRET_KEY may only use A-Z a-z 0-9 / + = . _ -" >&2; exit 2 ;;
  esac
done
if [ "${#S3_SECRET_KEY}" -lt 16 ]; then
  echo "S3_SECRET_KEY must be at least 16 characters" >&2
  exit 2
fi

umask 077
mkdir -p "$CONFIG_DIR" "$DATA_DIR"
cat > "$CONFIG_DIR/s3.json" <<JSON
{
  "identities": [
    {
      "name": "compilesvc",
      "credentials": [{"accessKey": "$S3_ACCESS_KEY", "secretKey": "$S3_SECRET_KEY"}],
      "actions": ["Admin", "Read", "List", "Tagging", "Write"]
    }
  ]
}
JSON

# -ip=127.0.0.1: the components inside this one process find each other on loopback, whatever address
# the container gets after a restart; -ip.bind=0.0.0.0 still serves S3 to the compose network.
# The Iceberg/Lance catalogs, WebDAV, the admin UI and telemetry are not used by compilesvc: off.
exec "$WEED" mini \
  -dir="$DATA_DIR" \
  -ip=127.0.0.1 \
  -ip.bind="${S3_BIND:-0.0.0.0}" \
  -s3.port="$S3_PORT" \
  -s3.config="$CONFIG_DIR/s3.json" \
  -s3.port.iceberg=0 \
  -s3.port.lance=0 \
  -webdav=false \
  -admin.ui=false \
  -master.telemetry=false \
  "$@"
