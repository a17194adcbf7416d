"""The transactions a submit writes the ledger in: creating or joining the set under its artifact row's lock
(:func:`create_or_join`), recording a set found only in the store (:func:`import_artifact`), and adding the
submit's build with its Idempotency-Key claim (:func:`add_build`). Which one runs, and when, is
:class:`~compilesvc.builds.submit.Submitter`'s.

Atomicity comes from unique keys: ``INSERT … ON CONFLICT DO NOTHING RETURNING id`` on the artifact key and on each
bucket key, in sorted key order so concurrent submits never deadlock. Dispatch messages go into the outbox in the
same transaction and are relayed only after commit.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from compilesvc.access import idempotency
from compilesvc.builds import provenance, set_changes
from compilesvc.builds.store_imports import bucket_manifests_of
from compilesvc.builds.submit_results import SubmitResult
from compilesvc.builds.submit_rows import SubmitContext
from compilesvc.compiles.bucket_compiles import positioned_buckets, views_of
from compilesvc.config.settings import Settings
from compilesvc.ledger import events
from compilesvc.ledger.build_records import BuildRecord, insert_build_details, insert_builds
from compilesvc.ledger.engine import transaction
from compilesvc.ledger.models import Artifact, utcnow
from compilesvc.ledger.sql import insert_ignore
from compilesvc.services import Services
from compilesvc.spec.manifest import ArtifactManifest, BucketManifest
from compilesvc.states import BUILD_STATE_FOR_ARTIFACT, ArtifactState, BucketState, Outcome, failed_for_good
from compilesvc.store.base import artifact_manifest_name


class IdempotencyRace(Exception):
    """Another request with the same Idempotency-Key committed between our check and our insert."""


class NeedsExclusive(Exception):
    """A submit holding the set's shared lock found it must change the set (see :func:`create_or_join`)."""


def add_build(session: Session, settings: Settings, ctx: SubmitContext, record: BuildRecord) -> int | None:
    """Record one submission in ``session``'s transaction; None when its Idempotency-Key was taken
    meanwhile (the caller rolls back and replays)."""
    [build_id] = insert_builds(session.connection(), [record])
    if ctx.idempotency_key and ctx.principal is not None:
        status = 200 if record.row["outcome"] == Outcome.HIT else 202  # as web.api.builds answers
        if not idempotency.claim(session, ctx.principal.token_id, ctx.idempotency_key, ctx.request_hash,
                                 build_id, status, settings.idempotency_key_seconds):
            return None
    # Its creation event tells the subscribers: its callbacks are recorded, and notified if it is born ended.
    insert_build_details(session, [record], [build_id])
    return build_id


def require_build(build_id: int | None) -> int:
    """``build_id``, or :class:`IdempotencyRace` (rolling the transaction back) when :func:`add_build` lost it."""
    if build_id is None:
        raise IdempotencyRace
    return build_id


def import_artifact(services: Services, ctx: SubmitContext, manifest: ArtifactManifest) -> SubmitResult:
    """A manifest in the store but not in the ledger (another region, a rebuilt ledger): record it."""
    imported = bucket_manifests_of(manifest)
    with transaction(services.sessions) as session:
        artifact_id = insert_ignore(session, Artifact, ctx.artifact_row(ArtifactState.PUBLISHED), ["key"])
        artifact = session.scalars(select(Artifact).where(Artifact.key == ctx.keys.key).with_for_update()).one()
        if artifact_id is not None:
            artifact.manifest_uri = services.store.document_location(artifact_manifest_name(ctx.keys.key))
            artifact.size_bytes = manifest.size_bytes
            artifact.published_at = utcnow()
            events.record(session, "artifact", artifact.id, None, ArtifactState.PUBLISHED, source="store")
            set_changes.link_buckets(session, services.store, services.settings.max_attempts, ctx, artifact,
                                     imported, set())
        build_id = require_build(add_build(
            session, services.settings, ctx, ctx.build_record(artifact.id, artifact.key, artifact.state, Outcome.HIT)))
        return SubmitResult(build_id=build_id, outcome=Outcome.HIT, state=BUILD_STATE_FOR_ARTIFACT[artifact.state],
                            artifact_key=artifact.key, artifact_state=artifact.state, buckets=[], manifest=manifest)


def create_or_join(services: Services, ctx: SubmitContext, imported: dict[str, BucketManifest] | None, *,
                   exclusive: bool) -> tuple[SubmitResult, list[int], bool]:
    """Create the set or join it, in one transaction holding the artifact row's lock: exclusively when
    this submit creates or changes the set (a reopen, a set failing for a remembered failure), shared
    when it only adds a build to it (a join, a hit), so that a burst of identical submits joins in
    parallel rather than one by one. Finishing workers, cancels and reopening submits lock the row
    exclusively: they wait for the joins in progress and see their builds. A submit that holds the
    shared lock and finds it must change the set raises :class:`NeedsExclusive` (its transaction is
    rolled back) and is run again with ``exclusive``: upgrading a shared lock in place would deadlock
    with another submit doing the same. So does a submit not admitted (``imported`` None: it expected a
    set in flight) that finds it must create the set.

    The answer, the outbox rows to relay after commit, and whether the set is complete (to publish after commit).
    """
    outbox_ids: list[int] = []
    with transaction(services.sessions) as session:
        artifact_id = insert_ignore(session, Artifact, ctx.artifact_row(ArtifactState.BUILDING), ["key"])
        if imported is None and artifact_id is not None:
            raise NeedsExclusive
        shared = artifact_id is None and not exclusive
        artifact = session.scalars(select(Artifact).where(Artifact.key == ctx.keys.key)
                                   .with_for_update(read=shared)).one()
        if shared and artifact.state not in (ArtifactState.BUILDING, ArtifactState.PUBLISHED):
            raise NeedsExclusive
        queued: set[int] = set()  # the compiles this submit queues: this build's own
        if artifact_id is not None:
            outcome = Outcome.NEW
            events.record(session, "artifact", artifact.id, None, ArtifactState.BUILDING)
            outbox_ids = set_changes.link_buckets(session, services.store, services.settings.max_attempts,
                                                  ctx, artifact, imported or {}, queued)
        elif artifact.state == ArtifactState.PUBLISHED:
            outcome = Outcome.HIT
        elif artifact.state == ArtifactState.BUILDING:
            outcome = Outcome.JOIN
        else:  # failed, cancelled or deleted: reopen unless a bucket failed for good (negative cache)
            outbox_ids = set_changes.reopen(session, artifact, ctx, queued)
            # Compiles queued again are this build's own work (new); a remembered failure, or a compile
            # still running, is something this build follows (join).
            outcome = Outcome.NEW if queued else Outcome.JOIN
        if not shared:
            set_changes.settle(session, artifact)
        # Read once: what this build got of each bucket, and the states `finalize` looks at.
        positioned = positioned_buckets(session, artifact.id)
        if shared and artifact.state == ArtifactState.BUILDING and any(
                failed_for_good(bucket.state, bucket.error_class) for bucket, _ in positioned):
            raise NeedsExclusive  # the set fails for it (set_changes.settle), which changes the set
        got = provenance.at_submit((bucket for bucket, _ in positioned), queued)
        build_id = require_build(add_build(
            session, services.settings, ctx,
            ctx.build_record(artifact.id, artifact.key, artifact.state, outcome, provenance=got)))
        provenance.record_origin(session, build_id, ctx.spec.model.name, sorted(queued))
        # A new set's answer is read again after commit (states only here, for `finalize`); a join's is
        # this one, with each bucket's failures (its manifest, if published, is read after commit).
        result = SubmitResult(build_id=build_id, outcome=outcome, state=BUILD_STATE_FOR_ARTIFACT[artifact.state],
                              artifact_key=artifact.key, artifact_state=artifact.state,
                              buckets=views_of(session, positioned, history=outcome != Outcome.NEW))
        finalize = artifact.state == ArtifactState.BUILDING and all(b.state == BucketState.SUCCEEDED
                                                                   for b in result.buckets)
    return result, outbox_ids, finalize
