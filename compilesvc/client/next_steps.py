"""What a person at the command line does next about an API refusal: one clause per problem type, appended
to the ``error:`` line of every client command (:class:`compilesvc.client.api.Api` with a token source).
The API's own ``detail`` says what is wrong; this says what to run or change. 401 and 403 are told by
:func:`compilesvc.client.api._auth_error` (they depend on where the token came from)."""

from __future__ import annotations

import re

NEXT_STEPS: dict[str, str] = {
    "build-not-found": "check the build id (`compilesvc builds` lists them)",
    "artifact-not-found": "check the key (the one `compilesvc submit` printed, or `compilesvc key SPEC`); "
                          "submit the spec to build it",
    "artifact-not-published": "wait for its build (`compilesvc status ID --wait`), or retry a failed one "
                              "(`compilesvc retry ID`)",
    "artifact-unsigned": "ask an admin to sign it (`compilesvc sign-artifacts KEY`) or rebuild it",
    "blob-not-found": "upload the model (`compilesvc upload FILE`) and use the blob:sha256: URI it prints",
    "campaign-not-found": "check the campaign id (`compilesvc campaigns` lists them)",
    "campaign-invalid": "fix the option named above (`compilesvc rollforward --help`)",
    "policy-not-found": "check the policy's id or name (`compilesvc rollforward-policies list`)",
    "policy-exists": "pick another name, or remove that policy first (`compilesvc rollforward-policies remove`)",
    "policy-invalid": "fix the option named above (`compilesvc rollforward-policies add --help`)",
    "pin-not-found": "check the pin id (`compilesvc pins list`)",
    "pin-invalid": "give --artifact a 64-hex key, --label a name=value",
    "token-not-found": "check the token id (`compilesvc tokens list --all`)",
    "token-invalid": "fix the option named above (`compilesvc tokens create --help`)",
    "not-cancellable": "it has finished: nothing to cancel (`compilesvc status ID` shows how it ended)",
    "not-retryable": "nothing in it failed or was cancelled (`compilesvc status ID` shows its buckets)",
    "spec-invalid": "fix the spec's fields named above; `compilesvc key SPEC` checks a spec offline",
    "model-ref-invalid": "upload the model (`compilesvc upload FILE`) and put the blob:sha256: URI it prints "
                         "in the spec's model.uri",
    "idempotency-key-reused": "pass a new --idempotency-key for a changed spec",
    "spec-over-quota": "split the buckets over several specs, or ask an admin to raise "
                       "COMPILESVC_MAX_COMPILES_PER_TOKEN",
    "subscription-not-found": "check the subscription id (GET /v1/subscriptions)",
}


def next_step(problem_type: str, message: str = "") -> str | None:
    """The clause for ``problem_type`` (the last segment of a problem's ``type``), if there is one and
    ``message`` (the API's words) does not name its command already."""
    step = NEXT_STEPS.get(problem_type)
    if step is None or any(command in message for command in re.findall(r"`([^`]+)`", step)):
        return None
    return step
