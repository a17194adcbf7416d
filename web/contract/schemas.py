"""Pydantic models of what the API accepts and answers; ``/openapi.json`` is generated from them.

Request bodies are validated by the core's own models (:class:`compilesvc.spec.compile_spec.CompileSpec`); query
strings and headers by :mod:`web.contract.inputs`' models, so the document cannot drift from what is enforced. Every
JSON response is validated against its model here and serialised from it (:func:`web.api.params.respond`; the
artifact lookup's cached layout once per manifest), so the document cannot drift from what is answered.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from compilesvc import states
from compilesvc.access.tokens import TEXT_PATTERN

# The state machines' enums (compilesvc/states.py), as the documented response schemas' enums. A Literal built
# at run time is no type mypy can read: to it they are the strings they hold.
if TYPE_CHECKING:
    BuildState = str
    ArtifactState = str
    BucketState = str
    Outcome = str
else:
    BuildState = Literal[tuple(s.value for s in states.BuildState)]
    ArtifactState = Literal[tuple(s.value for s in states.ArtifactState)]
    BucketState = Literal[tuple(s.value for s in states.BucketState)]
    Outcome = Literal[tuple(s.value for s in states.Outcome)]


def _integral(value: Any) -> Any:
    """JSON Schema's integer is any number without a fraction: 2.0 is the integer 2."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# Request bodies' scalars read as their JSON Schema says (lax pydantic would read 0, 1 and "yes" as booleans,
# "1.5" as a number, "60" or true as an integer): found by the conformance fuzz (bench/fuzz.py). Integers are
# strict ints after _integral.
JsonBool = Annotated[bool, Field(strict=True)]
JsonNumber = Annotated[float, Field(strict=True)]


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FieldError(_Out):
    field: str = Field(description='Dotted/indexed path of the offending field ("" for the whole body).')
    message: str


class ProblemDetails(BaseModel):
    """RFC 9457 problem details (``application/problem+json``); extensions vary by ``type``."""

    model_config = ConfigDict(extra="allow")

    type: str = Field(description='A URI reference naming the problem type; "about:blank" for plain HTTP errors.')
    title: str
    status: int
    detail: str
    instance: str = Field(description="The request path that failed.")
    errors: list[FieldError] | None = Field(default=None, description="Per-field errors (400/422).")


class BucketFailureOut(_Out):
    attempt: int
    at: datetime
    phase: str = Field(description="dispatch | fetch | compile | publish | lease")
    error_class: str = Field(description=" | ".join(c for c in states.ErrorClass if c != states.ErrorClass.CANCELLED))
    code: str | None
    message: str | None
    retried: bool = Field(description="Whether the step was retried (same attempt for a publish, else a new one).")
    log_sha256: str | None = Field(default=None, description="The attempt's whole compile log, archived as a blob.")
    log_size: int | None = None


class BucketOriginOut(_Out):
    how: str = Field(description="compiled (this build queued it) | joined (another build's compile was in "
                                 "flight) | reused (compiled before this build) | failed (a failure remembered "
                                 "from an earlier build) | imported (from the store) | not-compiled (its set "
                                 "had failed or was cancelled first) | unrecorded (older builds)")
    from_build: int | None = Field(description="The build whose compile it is, when not this build's own.")
    again_by: int | None = Field(default=None, description="A later build that compiled it again (a retry, or "
                                                         "a resubmit after retention): its state is that one's.")


class BucketOut(_Out):
    key: str
    position: int = Field(description="Index of the bucket in the spec as first submitted.")
    inputs: list[dict[str, Any]]
    state: BucketState
    attempts: int
    interruptions: int = Field(default=0, description="Attempts handed back by a draining worker; not counted.")
    error_class: str | None = Field(description=" | ".join(states.ErrorClass))
    error_code: str | None
    error_message: str | None
    worker_id: str | None = None
    cancel_requested: bool = Field(default=False, description="A running compile told to stop (its build was "
                                                               "cancelled); the worker has not ended it yet.")
    started_at: datetime | None = None
    finished_at: datetime | None = None
    compile_seconds: float | None = None
    queued_at: datetime | None = None
    origin: BucketOriginOut | None = Field(
        default=None, description="How this build got the bucket (GET /v1/builds/{id} only).")
    errors: list[BucketFailureOut] = Field(
        default_factory=list, description="Every failed step of this compile, first cause first; `error_*` "
                                          "above is the last.")


class FileOut(_Out):
    path: str
    role: str = Field(description="model | model-shard | weights-shard | log | aux (docs/api.md)")
    size: int
    sha256: str
    url: str = Field(description="Download URL, valid for `urls_expire_in` seconds from the response.")


class ArtifactBucketOut(_Out):
    key: str
    position: int
    inputs: list[dict[str, Any]]
    manifest: str
    files: list[FileOut]
    log: FileOut | None = None
    versions: dict[str, Any]
    compile_seconds: float | None = None


class ArtifactOut(_Out):
    """A published artifact: its manifest plus fresh expiring download URLs."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    schema_: str = Field(alias="schema")
    key: str
    material: dict[str, Any] = Field(description="Everything that went into the key (except bucket inputs).")
    components: dict[str, str] = Field(description="Per-component digests, for explaining cache misses.")
    buckets: list[ArtifactBucketOut]
    size_bytes: int
    created_at: str
    urls_expire_in: int


class BuildAccepted(_Out):
    """What POST /v1/builds answers: 202 while building, 200 with ``artifact`` once published."""

    build_id: int
    state: BuildState
    outcome: Outcome
    replayed: bool = Field(description="True when an Idempotency-Key replayed an earlier submit.")
    artifact_key: str
    artifact_state: ArtifactState
    buckets: list[BucketOut]
    status_url: str
    logs_url: str
    artifact: ArtifactOut | None = None


class EventOut(_Out):
    id: int
    at: datetime
    entity: str
    entity_id: int
    from_state: str | None
    to_state: str
    detail: dict[str, Any]


class BuildOut(_Out):
    """GET /v1/builds/{id}: the build, its artifact's state and buckets, recent events, and the artifact
    (with fresh URLs) once published."""

    build_id: int
    state: BuildState
    outcome: Outcome
    artifact_key: str
    artifact_state: ArtifactState
    submitted_by: str | None
    labels: dict[str, str]
    model_name: str | None
    model_sha256: str
    target: str
    sdk: str
    backend: str
    created_at: datetime
    finished_at: datetime | None
    spec: dict[str, Any]
    buckets: list[BucketOut]
    events: list[EventOut]
    status_url: str
    logs_url: str
    artifact: ArtifactOut | None


class KeyChangeOut(_Out):
    component: str = Field(description="schema | salt | model | toolchain | flags | buckets")
    text: str = Field(description='What changed, e.g. "sdk 2.20.0 → 2.21.0", "flag -O2 → -O3".')


class ComparedOut(_Out):
    artifact_key: str
    artifact_state: ArtifactState
    build_id: int = Field(description="The newest earlier build that made or joined that artifact.")
    sdk: str


class MissOut(_Out):
    """GET /v1/builds/{id}/miss: why a build's key was new: what changed since the closest earlier artifact
    of the same model (by name, else by content)."""

    build_id: int
    outcome: Outcome
    compared_with: ComparedOut | None = Field(description="null when no earlier build of the model asked for "
                                                          "another artifact.")
    changes: list[KeyChangeOut]


class BuildSummary(_Out):
    build_id: int
    state: BuildState
    outcome: Outcome
    artifact_key: str
    model_name: str | None
    model_sha256: str
    target: str
    sdk: str
    backend: str
    submitted_by: str | None
    labels: dict[str, str]
    created_at: datetime
    finished_at: datetime | None
    buckets_reused: int | None = Field(description="How many of its buckets were compiled before it was "
                                                   "submitted (all of them for a hit; null for older builds).")
    status_url: str


class BuildList(_Out):
    items: list[BuildSummary]
    next_cursor: str | None
    next: str | None = Field(description="URL of the next page (same filters), or null on the last page.")


class BuildStateOut(_Out):
    build_id: int
    state: BuildState
    artifact_state: ArtifactState
    status_url: str


class LogLineOut(_Out):
    id: int = Field(description="Monotonic line id; pass the last one seen as `after` (or Last-Event-ID).")
    bucket_key: str
    attempt: int
    at: datetime
    stream: str
    line: str


class LogPage(_Out):
    build_id: int
    build_state: BuildState
    lines: list[LogLineOut]
    next_after: int = Field(description="The `after` value for the next request.")
    finished: bool = Field(description="True when the build is finished and every line has been returned.")


class ResolvedBucket(_Out):
    key: str
    position: int
    inputs: list[dict[str, Any]]
    state: BucketState | Literal["absent"]


class ResolvedModel(_Out):
    uri: str
    sha256: str
    size: int | None


class ResolveOut(_Out):
    key: str
    schema_version: str
    components: dict[str, str]
    buckets: list[ResolvedBucket]
    state: ArtifactState | Literal["absent"]
    model: ResolvedModel
    artifact: ArtifactOut | None


class UploadOut(_Out):
    uri: str = Field(description='Use as the spec\'s model.uri: "blob:sha256:<hex>".')
    sha256: str
    size: int
    created: bool = Field(description="False when identical content was already stored; always true for a "
                                      "non-admin token under the team boundary (COMPILESVC_TEAM_READS), so an upload "
                                      "never tells one team that another holds the same bytes.")


class WorkerOut(_Out):
    id: str
    hostname: str
    capabilities: dict[str, Any]
    queues: list[str]
    slots: int
    started_at: datetime
    heartbeat_at: datetime
    draining_at: datetime | None = Field(description="Told to stop: takes no new compile, hands back late ones.")
    stopped_at: datetime | None
    live: bool


class QueueOut(_Out):
    name: str
    live_workers: int
    queued: int
    running: int


class WorkersOut(_Out):
    workers: list[WorkerOut]
    queues: list[QueueOut]


class HealthOut(_Out):
    status: Literal["ok"]


class ReadyOut(_Out):
    status: Literal["ready"]
    checks: dict[str, str]


class TokenCreate(BaseModel):
    """POST /v1/tokens: a token for ``owner`` (recorded as the submitter of its builds) in ``team`` (whose
    builds it may cancel and retry; default: the owner)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=100, pattern=TEXT_PATTERN,
                      description="What the token is for, e.g. `ci-vision`.")
    owner: str = Field(min_length=1, max_length=255, pattern=TEXT_PATTERN)
    team: str | None = Field(default=None, min_length=1, max_length=255, pattern=TEXT_PATTERN)
    scopes: (Annotated[list[Literal["fleet"]], Field(min_length=1, max_length=1)]
             | Annotated[list[Literal["read", "submit", "admin"]], Field(min_length=1)]) = Field(
        description="`fleet` alone, or any of read, submit, admin (each includes the ones before).")
    # Constraints before the validator: after it, pydantic writes them into the schema as "ge" and "le".
    expires_in_seconds: Annotated[int, Field(strict=True, ge=60, le=10 * 366 * 86400),
                                  BeforeValidator(_integral)] | None = Field(
        default=None, description="Unset: the token does not expire.")


class TokenOut(_Out):
    id: int
    name: str
    owner: str
    team: str
    scopes: list[str]
    hint: str = Field(description="The token's first characters, to tell tokens apart; the rest is never shown.")
    created_at: datetime
    created_by: str | None
    expires_at: datetime | None
    last_used_at: datetime | None
    revoked_at: datetime | None


class TokenCreated(TokenOut):
    token: str = Field(description="The secret, shown this once: only its sha256 is kept.")


class TokenList(_Out):
    items: list[TokenOut]


class WebhookAttemptOut(_Out):
    attempt: int
    at: datetime
    status_code: int | None = Field(description="The receiver's HTTP status; null when it did not answer.")
    error: str | None
    duration_ms: float


class WebhookDeliveryOut(_Out):
    id: str = Field(description="The Compilesvc-Webhook-Id header of every try: receivers dedupe by it.")
    url: str
    event: Literal["build.succeeded", "build.failed", "build.cancelled"]
    state: Literal["pending", "delivered", "failed"]
    attempts: list[WebhookAttemptOut]
    next_attempt_at: datetime | None = Field(description="When it is tried again (pending deliveries).")
    created_at: datetime
    delivered_at: datetime | None


class WebhookDeliveries(_Out):
    build_id: int
    urls: list[str] = Field(description="The build's webhook URLs: its spec's callbacks and its team's.")
    deliveries: list[WebhookDeliveryOut]


class SigningKeyOut(_Out):
    key_id: str = Field(description="sha256 hex of the PEM SubjectPublicKeyInfo (a signature's publicKey.hint).")
    public_key: str = Field(description="The PEM public key.")
    current: bool = Field(description="The key this API process signs with now (others: trusted during a rotation).")


class SigningKeysOut(_Out):
    """For convenience only: a fleet trusts the keys it was given out of band, not these (docs/fleet.md)."""

    keys: list[SigningKeyOut]
