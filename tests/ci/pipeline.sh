#!/usr/bin/env bash
# A CI pipeline as a user writes one (docs/ci.md), played against a running compilesvc by
# tests/test_ci_pipeline.py. It exits 0 only if every step answered as documented; each failed check says
# which. Inputs (environment): COMPILESVC_API_URL (through a proxy that can lose one answer),
# COMPILESVC_TOKEN (an admin's, to make the pipeline's own token), MODEL, SPEC_OK, SPEC_FAILS,
# SPEC_INVALID, SPEC_CUT, CUT_FLAG (touch it to lose the next submit's answer), API_DOWN_URL, WORK,
# EXPECTED_CODE (the error code the compiler prints for SPEC_FAILS).
set -uo pipefail
cd "$WORK"

fail() { echo "pipeline check failed: $*" >&2; exit 1; }
expect_exit() {  # expect_exit WANT NAME -- command...: run it, keep stdout/stderr in NAME.out/NAME.err
    local want=$1 name=$2; shift 3
    "$@" >"$name.out" 2>"$name.err"
    local got=$?
    [ "$got" = "$want" ] || fail "$name: exit $got, expected $want; stderr: $(cat "$name.err")"
}

# The pipeline's own token: submit scope, team "vision"; the admin's goes no further than this.
COMPILESVC_TOKEN=$(compilesvc tokens create --name ci-vision --owner ci-vision --team vision --scope submit) \
    || fail "tokens create"
export COMPILESVC_TOKEN

# 1. Upload; the URI is content-addressed, so it is the one the specs name.
uri=$(compilesvc upload "$MODEL") || fail "upload"
grep -q "$uri" "$SPEC_OK" || fail "upload printed $uri, which the spec does not name"

# 2. Submit and wait: exit 0, the key on stdout, progress (by bucket position and shape) on stderr.
expect_exit 0 built -- compilesvc submit "$SPEC_OK" --timeout 120 --poll 0.3
key=$(cat built.out)
[[ $key =~ ^[0-9a-f]{64}$ ]] || fail "submit printed '$key', not an artifact key"
grep -q "/builds/" built.err || fail "submit did not name the build page"
grep -q "bucket 0 (input_ids: int64\[1, 16\]" built.err || fail "no progress line per bucket: $(cat built.err)"

# 3. The same again: a hit, as one JSON document a pipeline parses.
expect_exit 0 hit -- compilesvc submit "$SPEC_OK" --json
python3 - "$key" hit.out <<'PY' || fail "the --json document: $(cat hit.out)"
import json, sys
doc = json.load(open(sys.argv[2]))
assert doc["key"] == sys.argv[1] and doc["outcome"] == "hit" and doc["result"] == "succeeded", doc
assert doc["exit_code"] == 0 and doc["artifact_url"].endswith("/v1/artifacts/" + sys.argv[1]), doc
# A hit compiles nothing: every bucket is the first build's.
assert [(b["state"], b["origin"]["how"]) for b in doc["buckets"]] == [("succeeded", "reused")] * len(doc["buckets"]), doc
assert doc["buckets"], doc
PY

# 4. A model that does not compile: exit 1, and the compiler's own message in the output.
expect_exit 1 compile_error -- compilesvc submit "$SPEC_FAILS" --timeout 120 --poll 0.3
grep -q "$EXPECTED_CODE" compile_error.err || fail "the compiler's error code is not shown: $(cat compile_error.err)"
grep -q "bucket 0 (input_ids: int64\[1, 16\]" compile_error.err || fail "the failed bucket is not named by shape"

# 5. A spec that is wrong: exit 2, before anything is built.
expect_exit 2 invalid -- compilesvc submit "$SPEC_INVALID"

# 6. The API is down: exit 3, after the client retried.
expect_exit 3 down -- env COMPILESVC_API_URL="$API_DOWN_URL" compilesvc submit "$SPEC_OK"
grep -q "cannot reach the API" down.err || fail "no reason given for exit 3: $(cat down.err)"
grep -q "check the address (--api, COMPILESVC_API_URL or the config file), or try again later" down.err \
    || fail "exit 3 does not say what to do: $(cat down.err)"

# 7. The network loses the answer to a submit: the client retries with the same Idempotency-Key, so there
#    is one build.
touch "$CUT_FLAG"
expect_exit 0 cut -- compilesvc submit "$SPEC_CUT" --no-wait
[ ! -e "$CUT_FLAG" ] || fail "the proxy never cut the submit's answer"
build_id=$(cat cut.out)
[[ $build_id =~ ^[0-9]+$ ]] || fail "submit --no-wait printed '$build_id', not the build id"
expect_exit 0 waited -- compilesvc status "$build_id" --wait --timeout 120 --poll 0.3
[ "$(cat waited.out)" != "$key" ] || fail "the cut spec's build produced the first spec's key"
count=$(compilesvc builds --model cut-model --json | python3 -c 'import json, sys; print(len(json.load(sys.stdin)))')
[ "$count" = 1 ] || fail "$count builds of the cut submit, expected 1"
grep -q "first answer to this Idempotency-Key" cut.err || fail "the retry was not a replay: $(cat cut.err)"

echo "pipeline: all checks passed"
