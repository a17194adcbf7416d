#!/bin/sh
# Start SeaweedFS `weed mini` (master, volume, filer and S3 gateway in one process) for compilesvc.
#
# The S3 identities are written from the S3_*_KEY variables at every start (identities.sh), so the only
# copy of the secrets is the environment (docker-compose.yml takes them from .env); nothing secret lives
# in the repo.
# Bind-mounted read-only into the chrislusf/seaweedfs image by docker-compose.yml; also runs outside
# Docker (WEED=/path/to/weed S3_DATA_DIR=/tmp/x sh docker/seaweedfs/start.sh).
set -eu

: "${S3_ACCESS_KEY:?S3_ACCESS_KEY must be set}"
: "${S3_SECRET_KEY:?S3_SECRET_KEY must be set}"
WEED="${WEED:-weed}"
DATA_DIR="${S3_DATA_DIR:-/data}"
S3_PORT="${S3_PORT:-8333}"
CONFIG_DIR="${S3_CONFIG_DIR:-/tmp/compilesvc-s3}"

umask 077
mkdir -p "$CONFIG_DIR" "$DATA_DIR"
# One identity per service, each limited to what that service does (identities.sh says what and why).
sh "$(dirname "$0")/identities.sh" "$CONFIG_DIR/s3.json"

# -ip=127.0.0.1: the components inside this one process find each other on loopback, whatever address
# the container gets after a restart; -ip.bind=0.0.0.0 serves S3 to the compose network (inside the
# container: docker-compose.yml publishes the port on the host's loopback only).
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
