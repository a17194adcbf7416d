"""Ledger tables: artifacts, bucket compiles, builds, events, workers, log lines, outbox, model pins, API
tokens and idempotency keys (webhooks, campaigns, retention and UI sessions have modules of their own
here; the package imports them all, so every table is on :data:`Base.metadata` whichever is imported first).

Unique constraints carry the dedupe: one ``artifacts`` row per artifact key, one ``bucket_compiles`` row per
bucket key, one ``builds`` row per idempotency key. A bucket compile may belong to many artifacts (a set
that adds a bucket reuses the others), hence the ``artifact_buckets`` link.

The state machines of artifacts, bucket compiles and builds are :mod:`compilesvc.states`; every state
column has a CHECK constraint generated from its enum, and every transition writes an ``events`` row.
``bucket_failures`` keeps the cause of every failed step of a compile, in order, so that the first cause
of a failure is never hidden by the last.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from compilesvc.states import (
    ArtifactState,
    BucketState,
    BuildState,
    ErrorClass,
    Outcome,
)

# Autoincrementing 64-bit ids; SQLite only autoincrements "INTEGER PRIMARY KEY".
BigId = BigInteger().with_variant(Integer(), "sqlite")
Json = JSON().with_variant(JSONB(), "postgresql")


def check_constraint(column: str, states: type[StrEnum], name: str) -> CheckConstraint:
    """The schema's CHECK that ``column`` holds one of ``states`` (named by the naming convention)."""
    values = ", ".join(f"'{s.value}'" for s in states)
    return CheckConstraint(f"{column} IN ({values})", name=name)


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite stores them naive)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to the ledger; use compilesvc.ledger.models.utcnow()")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def utcnow() -> datetime:
    return datetime.now(UTC)


NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: Json, list[Any]: Json}


class Artifact(Base):
    __tablename__ = "artifacts"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    key: Mapped[str] = mapped_column(String(64), unique=True)
    state: Mapped[str] = mapped_column(String(16))
    target: Mapped[str] = mapped_column(String(16))
    sdk: Mapped[str] = mapped_column(String(32))
    backend: Mapped[str] = mapped_column(String(32))
    model_sha256: Mapped[str] = mapped_column(String(64))
    material: Mapped[dict[str, Any]] = mapped_column(doc="Set-level key material (canonical, no buckets).")
    components: Mapped[dict[str, Any]]
    manifest_uri: Mapped[str | None] = mapped_column(String(1024))
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    published_at: Mapped[datetime | None]
    deleted_at: Mapped[datetime | None] = mapped_column(doc="When retention marked it deleted.")
    last_fetched_at: Mapped[datetime | None] = mapped_column(doc="Last lookup by key (recorded in batches).")
    fetch_count: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")

    __table_args__ = (
        Index("ix_artifacts_model_sha256", "model_sha256"),  # a model's artifacts (the artifacts page)
        check_constraint("state", ArtifactState, "state"),
    )


class BucketCompile(Base):
    __tablename__ = "bucket_compiles"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    key: Mapped[str] = mapped_column(String(64), unique=True)
    state: Mapped[str] = mapped_column(String(16))
    target: Mapped[str] = mapped_column(String(16))
    sdk: Mapped[str] = mapped_column(String(32))
    backend: Mapped[str] = mapped_column(String(32))
    queue: Mapped[str] = mapped_column(String(128))
    model: Mapped[dict[str, Any]] = mapped_column(doc="How to fetch the model: pinned uri, sha256, size, format.")
    material: Mapped[dict[str, Any]]
    inputs: Mapped[list[Any]]
    attempts: Mapped[int] = mapped_column(default=0)
    max_attempts: Mapped[int] = mapped_column(default=3)
    attempt_round: Mapped[int] = mapped_column(
        default=0, server_default="0",
        doc="Bumped whenever the attempts are reset (a resubmit, an explicit retry): failures count per round.")
    interruptions: Mapped[int] = mapped_column(
        default=0, server_default="0", doc="Attempts a draining worker gave back: not counted against max_attempts.")
    lease_token: Mapped[int] = mapped_column(BigInteger, default=0)
    lease_expires_at: Mapped[datetime | None]
    worker_id: Mapped[str | None] = mapped_column(String(255))
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    error_class: Mapped[str | None] = mapped_column(String(16), doc=" | ".join(ErrorClass))
    error_code: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(Text)
    manifest_uri: Mapped[str | None] = mapped_column(String(1024))
    versions: Mapped[dict[str, Any] | None] = mapped_column(Json, doc="Compiler/runtime versions used.")
    queued_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    compile_seconds: Mapped[float | None] = mapped_column(Float)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column(doc="When retention marked its files deleted.")
    origin_build_id: Mapped[int | None] = mapped_column(
        BigInteger, doc="The build whose submit or retry last queued it (compilesvc.builds.provenance).")
    model_name: Mapped[str | None] = mapped_column(
        String(200), doc="That build's model name (the statistics group compile times by it).")

    __table_args__ = (
        # The reaper's scan: running compiles whose lease ran out.
        Index("ix_bucket_compiles_state_lease", "state", "lease_expires_at"),
        # The statistics' windows (compilesvc.insights.stats): compile times by finish, queue waits by start.
        Index("ix_bucket_compiles_finished_at", "finished_at"),
        Index("ix_bucket_compiles_started_at_queued_at", "started_at", "queued_at"),  # index-only waits
        # KEDA's scaler query (the Helm chart's): a pool's queued and running compiles, from this index alone.
        Index("ix_bucket_compiles_active_queue", "queue", "state",
              postgresql_where=text("state IN ('queued', 'running')"),
              sqlite_where=text("state IN ('queued', 'running')")),
        check_constraint("state", BucketState, "state"),
        check_constraint("error_class", ErrorClass, "error_class"),
    )


class ArtifactBucket(Base):
    __tablename__ = "artifact_buckets"

    artifact_id: Mapped[int] = mapped_column(ForeignKey("artifacts.id", ondelete="CASCADE"), primary_key=True)
    bucket_compile_id: Mapped[int] = mapped_column(
        ForeignKey("bucket_compiles.id", ondelete="CASCADE"), primary_key=True
    )
    position: Mapped[int] = mapped_column(Integer)

    __table_args__ = (Index("ix_artifact_buckets_bucket_compile_id", "bucket_compile_id"),)


class Build(Base):
    __tablename__ = "builds"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    artifact_id: Mapped[int] = mapped_column(ForeignKey("artifacts.id"))
    artifact_key: Mapped[str] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(16))
    outcome: Mapped[str] = mapped_column(String(8), doc="hit | join | new")
    submitted_by: Mapped[str | None] = mapped_column(String(255))
    labels: Mapped[dict[str, Any]]
    spec: Mapped[dict[str, Any]] = mapped_column(doc="The spec as submitted (validated).")
    model_name: Mapped[str | None] = mapped_column(String(200))
    model_sha256: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(16))
    sdk: Mapped[str] = mapped_column(String(32))
    backend: Mapped[str] = mapped_column(String(32))
    idempotency_key: Mapped[str | None] = mapped_column(String(255), doc="As sent; replays: idempotency_keys.")
    request_hash: Mapped[str | None] = mapped_column(String(64))
    token_id: Mapped[int | None] = mapped_column(ForeignKey("api_tokens.id"), doc="The token that submitted.")
    team: Mapped[str | None] = mapped_column(String(255), doc="The submitting token's team: who may control it.")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]
    buckets_reused: Mapped[int | None] = mapped_column(
        Integer, doc="How many of its buckets were compiled before it was submitted (all, for a hit).")
    buckets_compiled: Mapped[int | None] = mapped_column(
        Integer, doc="How many of its buckets it queued itself (none, for a hit or a join).")
    provenance: Mapped[dict[str, Any] | None] = mapped_column(
        # None is SQL NULL (not JSON null), as Postgres' batch writer (compilesvc.ledger.build_records) stores it.
        JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql"),
        doc="Per bucket compile id: how this build got it and from which build (compilesvc.builds.provenance).")

    __table_args__ = (
        # Keyset-paginated history: newest first by id, optionally filtered by one column.
        Index("ix_builds_target_id", "target", "id"),
        Index("ix_builds_sdk_id", "sdk", "id"),
        Index("ix_builds_state_id", "state", "id"),
        Index("ix_builds_model_sha256_id", "model_sha256", "id"),
        Index("ix_builds_model_name_id", "model_name", "id"),
        Index("ix_builds_submitted_by_id", "submitted_by", "id"),
        # A team's builds, newest first: the history under the team boundary for reads (compilesvc.access.team_reads).
        Index("ix_builds_team_id", "team", "id"),
        # A token's builds in flight (its concurrent-compile quota).
        Index("ix_builds_token_id_state", "token_id", "state"),
        # The two filters the history UI shows side by side; SDK releases follow time (see 0003).
        Index("ix_builds_target_sdk_id", "target", "sdk", "id"),
        # An artifact's builds, newest first (its newest build and name on the artifacts page; cancel).
        Index("ix_builds_artifact_id_id", "artifact_id", "id"),
        # The statistics' outcomes over a window (compilesvc.insights.stats), read from the index alone.
        Index("ix_builds_created_at_outcome_reuse", "created_at", "outcome", "buckets_reused", "buckets_compiled"),
        check_constraint("state", BuildState, "state"),
        check_constraint("outcome", Outcome, "outcome"),
    )


class BuildLabel(Base):
    """Labels exploded for filtering history by ``label=name:value`` without scanning JSON."""

    __tablename__ = "build_labels"

    build_id: Mapped[int] = mapped_column(ForeignKey("builds.id", ondelete="CASCADE"), primary_key=True)
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(1024))

    __table_args__ = (Index("ix_build_labels_name_value_build_id", "name", "value", "build_id"),)


class Event(Base):
    __tablename__ = "events"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    at: Mapped[datetime] = mapped_column(default=utcnow)
    entity: Mapped[str] = mapped_column(String(16), doc="build | artifact | bucket | campaign")
    entity_id: Mapped[int] = mapped_column(BigInteger)
    from_state: Mapped[str | None] = mapped_column(String(16))
    to_state: Mapped[str] = mapped_column(String(16))
    detail: Mapped[dict[str, Any]] = mapped_column(default=dict)

    __table_args__ = (Index("ix_events_entity_entity_id_id", "entity", "entity_id", "id"),)


class Worker(Base):
    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(String(255), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(255))
    capabilities: Mapped[dict[str, Any]]
    queues: Mapped[list[Any]]
    slots: Mapped[int] = mapped_column(Integer, default=1)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow)
    draining_at: Mapped[datetime | None] = mapped_column(doc="Told to stop: takes no new work, hands back late work.")
    stopped_at: Mapped[datetime | None]

    __table_args__ = (Index("ix_workers_heartbeat_at", "heartbeat_at"),)


class LogLine(Base):
    __tablename__ = "log_lines"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    bucket_compile_id: Mapped[int] = mapped_column(ForeignKey("bucket_compiles.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    at: Mapped[datetime] = mapped_column(default=utcnow)
    stream: Mapped[str] = mapped_column(String(16), doc="compiler | service")
    line: Mapped[str] = mapped_column(Text)

    __table_args__ = (Index("ix_log_lines_bucket_compile_id_id", "bucket_compile_id", "id"),)


class Outbox(Base):
    """Messages to Celery, written in the same transaction as the rows they announce."""

    __tablename__ = "outbox"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    bucket_compile_id: Mapped[int] = mapped_column(ForeignKey("bucket_compiles.id", ondelete="CASCADE"))
    task_name: Mapped[str] = mapped_column(String(128))
    task_id: Mapped[str] = mapped_column(String(128), unique=True)
    kwargs: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    sent_at: Mapped[datetime | None]
    available_at: Mapped[datetime | None] = mapped_column(
        doc="Not sent before this time: the backoff before an infrastructure retry.")
    send_attempts: Mapped[int] = mapped_column(default=0)
    last_error: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        # The latest dispatch of a compile (the reconciler's re-send).
        Index("ix_outbox_bucket_compile_id_id", "bucket_compile_id", "id"),
        Index(
            "ix_outbox_unsent",
            "id",
            postgresql_where=text("sent_at IS NULL"),
            sqlite_where=text("sent_at IS NULL"),
        ),
    )


class ModelPin(Base):
    """An immutable model identity (S3 version id, or ETag + size) and its content sha256, computed once."""

    __tablename__ = "model_pins"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    uri: Mapped[str] = mapped_column(String(1024))
    version_id: Mapped[str] = mapped_column(String(1024), default="")
    etag: Mapped[str] = mapped_column(String(255), default="")
    size: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    __table_args__ = (UniqueConstraint("uri", "version_id", "etag", "size"),)


class PinJob(Base):
    """A large S3 object being hashed in the background for its pin (:mod:`compilesvc.pinning.hash_jobs`): one per
    object identity (as :class:`ModelPin`), claimed by one API process at a time with a lease it renews."""

    __tablename__ = "pin_jobs"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    uri: Mapped[str] = mapped_column(String(1024))
    version_id: Mapped[str] = mapped_column(String(1024), default="")
    etag: Mapped[str] = mapped_column(String(255), default="")
    size: Mapped[int] = mapped_column(BigInteger)
    state: Mapped[str] = mapped_column(String(16), doc="hashing, done or failed")
    bytes_done: Mapped[int] = mapped_column(BigInteger, default=0)
    owner: Mapped[str | None] = mapped_column(String(255), doc="The claiming process (host:pid:nonce).")
    lease_until: Mapped[datetime | None] = mapped_column()
    sha256: Mapped[str | None] = mapped_column(String(64))
    error: Mapped[str | None] = mapped_column(Text)
    store_failures: Mapped[int] = mapped_column(default=0, server_default="0",
                                                doc="Reads that failed in a row (the store unavailable or refusing).")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)

    __table_args__ = (UniqueConstraint("uri", "version_id", "etag", "size"),)


class CheckpointPin(Base):
    """What an uploaded checkpoint archive (a blob: immutable, named by its sha256) gives a key: config.json and,
    once computed, its weights' digests (:mod:`compilesvc.pinning.checkpoints`). Also, under the digest of the
    pinned identities (key, version id, ETag, size) of the small files an S3 prefix's pin read, what they gave
    (``material["kind"] == "s3-prefix-reads"``, :mod:`compilesvc.pinning.prefix_reads`). Either is read once."""

    __tablename__ = "checkpoint_pins"

    blob_sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    material: Mapped[dict[str, Any]] = mapped_column(Json, doc="CheckpointMaterial.as_json()")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class BucketFailure(Base):
    """One failed step of a bucket compile: a failed attempt, a publish that will be retried, a lost
    dispatch. Kept in order, so a build shows its first cause first (the compile's own ``error_*``
    columns hold only the last)."""

    __tablename__ = "bucket_failures"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    bucket_compile_id: Mapped[int] = mapped_column(ForeignKey("bucket_compiles.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    attempt_round: Mapped[int] = mapped_column(Integer, default=0, server_default="0",
                                               doc="The compile's attempt_round when this failure happened.")
    at: Mapped[datetime] = mapped_column(default=utcnow)
    phase: Mapped[str] = mapped_column(String(16), doc="dispatch | fetch | compile | publish | lease | worker")
    error_class: Mapped[str] = mapped_column(String(16))
    code: Mapped[str | None] = mapped_column(String(64))
    message: Mapped[str | None] = mapped_column(Text)
    retry: Mapped[bool] = mapped_column(Boolean, default=False, doc="Whether it was retried.")
    log_sha256: Mapped[str | None] = mapped_column(String(64), doc="The attempt's archived log (a store blob).")
    log_size: Mapped[int | None] = mapped_column(BigInteger)

    __table_args__ = (
        Index("ix_bucket_failures_bucket_compile_id_id", "bucket_compile_id", "id"),
        Index("ix_bucket_failures_at", "at"),  # the statistics' failures by class over a window
        check_constraint("error_class", ErrorClass, "error_class"),
    )


class ApiToken(Base):
    """An API token: only the sha256 of its secret is kept (:mod:`compilesvc.access.tokens`)."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    name: Mapped[str] = mapped_column(String(100))
    owner: Mapped[str] = mapped_column(String(255), doc="Recorded as the submitter of the token's builds.")
    team: Mapped[str] = mapped_column(String(255), doc="Whose builds the token may cancel and retry.")
    scopes: Mapped[list[Any]] = mapped_column(doc="fleet | read | submit | admin")
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    hint: Mapped[str] = mapped_column(String(16), doc="The secret's first characters, to tell tokens apart.")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    created_by: Mapped[str | None] = mapped_column(String(255))
    expires_at: Mapped[datetime | None]
    last_used_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]


class IdempotencyKey(Base):
    """A submit's Idempotency-Key, per token, and the build it made: a repeat with the same body replays
    that answer, with another body is refused. Expired keys are deleted by the relay's sweep."""

    __tablename__ = "idempotency_keys"

    token_id: Mapped[int] = mapped_column(ForeignKey("api_tokens.id", ondelete="CASCADE"), primary_key=True)
    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    request_hash: Mapped[str] = mapped_column(String(64))
    build_id: Mapped[int] = mapped_column(ForeignKey("builds.id", ondelete="CASCADE"))
    status: Mapped[int] = mapped_column(Integer, doc="The HTTP status first answered (200 hit, 202 otherwise).")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    __table_args__ = (Index("ix_idempotency_keys_created_at", "created_at"),)

