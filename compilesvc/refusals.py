"""Requests the service refuses as given (submit, cancel, retry), each with the HTTP status and problem
code the API answers with; the core raises them, ``web`` only translates."""

from __future__ import annotations


class SubmitRefused(Exception):
    """A request (submit, cancel, retry) the service will not carry out as given; ``status`` is the HTTP
    status to answer with."""

    status = 409
    code = "submit-refused"


class NoCapableWorker(SubmitRefused):
    status = 503
    code = "no-capable-worker"

    def __init__(self, queue: str, target: str, sdk: str, reason: str | None = None):
        self.queue = queue
        self.reason = reason
        why = f"; {reason}" if reason else ""
        super().__init__(
            f"no live worker serves target {target} with SDK {sdk} (queue {queue}){why}; start one with "
            f"`compilesvc worker`, or submit with ?queue_anyway=true (compilesvc submit --queue-anyway) to queue "
            "it until one starts"
        )


class IdempotencyConflict(SubmitRefused):
    status = 422
    code = "idempotency-key-reused"

    def __init__(self, key: str):
        super().__init__(f"Idempotency-Key {key!r} was already used with a different request body")


class NotCancellable(SubmitRefused):
    code = "not-cancellable"


class NotRetryable(SubmitRefused):
    code = "not-retryable"


class NotYourBuild(SubmitRefused):
    status = 403
    code = "not-your-build"

    def __init__(self, build_id: int, team: str | None):
        owner = f"team {team}" if team else "no team (submitted before tokens existed)"
        super().__init__(f"build {build_id} belongs to {owner}; cancel and retry need a token of that team with "
                         "the submit scope, or an admin token")
