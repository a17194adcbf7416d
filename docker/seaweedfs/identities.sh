#!/bin/sh
# Write SeaweedFS's S3 identities (the -s3.config JSON) for compilesvc: one identity per service, each
# allowed what that service does and nothing more (docs/security.md, "Compose: least privilege").
#
#   sh docker/seaweedfs/identities.sh OUT.json
#
# From the environment (docker-compose.yml passes them to the s3 service only):
#   S3_ACCESS_KEY / S3_SECRET_KEY                 admin: s3-init (bucket, lifecycle) and `compilesvc gc`
#   S3_API_ACCESS_KEY / S3_API_SECRET_KEY         api
#   S3_WORKER_ACCESS_KEY / S3_WORKER_SECRET_KEY   worker-cpu, worker-neuron
#   S3_RELAY_ACCESS_KEY / S3_RELAY_SECRET_KEY     relay
#   S3_BUCKET, S3_PREFIX                          where the store is (COMPILESVC_STORE_URL s3://BUCKET/PREFIX)
# A service whose two keys are unset gets no identity.
#
# SeaweedFS's action syntax (weed/s3api/auth_credentials.go, Identity.CanDo): "Action" anywhere,
# "Action:bucket" for one bucket, "Action:bucket/path*" with a wildcard for keys under a prefix. Write
# covers PUT, multipart (create, parts, complete, abort), copy and DELETE of objects; Read covers GET,
# HEAD and listing multipart uploads; List covers listing objects; only Admin may create or delete
# buckets or set their lifecycle and policies.
#
# What each service writes (compilesvc/store/base.py's names under PREFIX):
#   api      blobs/ (model uploads it received and hashed) and artifacts/ (the manifest of an artifact
#            whose buckets all exist already, compilesvc/builds/submit.py); never buckets/ (compile results)
#   worker   blobs/ (outputs), buckets/ and artifacts/ manifests
#   relay    blobs/ (aborting abandoned multipart uploads) and artifacts/ (late publishes, the reaper)
set -eu

OUT="${1:?usage: identities.sh OUT.json}"
BUCKET="${S3_BUCKET:-compilesvc}"
PREFIX="${S3_PREFIX-artifacts}"
ROOT="$BUCKET${PREFIX:+/$PREFIX}"

: "${S3_ACCESS_KEY:?S3_ACCESS_KEY must be set}"
: "${S3_SECRET_KEY:?S3_SECRET_KEY must be set}"

check() {  # name access secret: the keys go into JSON unescaped, so only what AWS-style keys use
  for value in "$2" "$3"; do
    case "$value" in
      *[!A-Za-z0-9/+=._-]*) echo "$1: S3 keys may only use A-Z a-z 0-9 / + = . _ -" >&2; exit 2 ;;
    esac
  done
  if [ "${#3}" -lt 16 ]; then
    echo "$1: the S3 secret key must be at least 16 characters" >&2
    exit 2
  fi
}
for value in "$BUCKET" "$PREFIX"; do
  case "$value" in
    *[!A-Za-z0-9/._-]*) echo "S3_BUCKET/S3_PREFIX may only use A-Z a-z 0-9 / . _ -" >&2; exit 2 ;;
  esac
done

identity() {  # name access secret actions-json
  check "$1" "$2" "$3"
  printf '    {"name": "%s", "credentials": [{"accessKey": "%s", "secretKey": "%s"}], "actions": %s}' \
    "$1" "$2" "$3" "$4"
}

umask 077
{
  echo '{'
  echo '  "identities": ['
  identity admin "$S3_ACCESS_KEY" "$S3_SECRET_KEY" '["Admin", "Read", "List", "Tagging", "Write"]'
  if [ -n "${S3_API_ACCESS_KEY:-}" ] || [ -n "${S3_API_SECRET_KEY:-}" ]; then
    echo ','
    identity api "${S3_API_ACCESS_KEY:-}" "${S3_API_SECRET_KEY:-}" \
      "[\"Read:$BUCKET\", \"List:$BUCKET\", \"Write:$ROOT/blobs/*\", \"Write:$ROOT/artifacts/*\"]"
  fi
  if [ -n "${S3_WORKER_ACCESS_KEY:-}" ] || [ -n "${S3_WORKER_SECRET_KEY:-}" ]; then
    echo ','
    identity worker "${S3_WORKER_ACCESS_KEY:-}" "${S3_WORKER_SECRET_KEY:-}" \
      "[\"Read:$BUCKET\", \"List:$BUCKET\", \"Write:$ROOT/blobs/*\", \"Write:$ROOT/buckets/*\", \"Write:$ROOT/artifacts/*\"]"
  fi
  if [ -n "${S3_RELAY_ACCESS_KEY:-}" ] || [ -n "${S3_RELAY_SECRET_KEY:-}" ]; then
    echo ','
    identity relay "${S3_RELAY_ACCESS_KEY:-}" "${S3_RELAY_SECRET_KEY:-}" \
      "[\"Read:$BUCKET\", \"List:$BUCKET\", \"Write:$ROOT/blobs/*\", \"Write:$ROOT/artifacts/*\"]"
  fi
  echo
  echo '  ]'
  echo '}'
} > "$OUT.tmp"
mv "$OUT.tmp" "$OUT"
