"""What a submit changes in a set of bucket compiles, inside the submit's transaction and under the set's
exclusive lock (:func:`compilesvc.builds.submit_transactions.create_or_join` decides when): linking a new set's
buckets, reopening a finished one, and failing one that holds a bucket failed for good. Each queued compile's
id goes into the caller's ``queued`` (the build's own compiles: :mod:`compilesvc.builds.provenance`), each dispatch
into the outbox, relayed after commit."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from compilesvc.builds.admission import will_compile
from compilesvc.builds.submit_rows import SubmitContext
from compilesvc.compiles.bucket_compiles import linked_buckets, requeue_bucket
from compilesvc.dispatch.outbox import enqueue_compile
from compilesvc.ledger import events
from compilesvc.ledger.models import Artifact, ArtifactBucket, BucketCompile
from compilesvc.ledger.sql import insert_ignore
from compilesvc.lifecycle.artifacts import fail_artifacts_of_bucket, set_artifact_state
from compilesvc.spec.manifest import BucketManifest
from compilesvc.states import ArtifactState, BucketState, failed_for_good
from compilesvc.store.base import ArtifactStore, bucket_manifest_name


def link_buckets(session: Session, store: ArtifactStore, max_attempts: int, ctx: SubmitContext, artifact: Artifact,
                 imported: dict[str, BucketManifest], queued: set[int]) -> list[int]:
    """Create (or reuse) one bucket compile per unique bucket key and link it to the artifact."""
    outbox_ids = []
    positions: dict[str, int] = {}
    for bucket_key in ctx.keys.buckets:
        positions.setdefault(bucket_key.key, bucket_key.position)
    inputs = {b.key: b.inputs for b in ctx.keys.buckets}
    for key in sorted(positions):  # sorted: concurrent submits take unique-index locks in one order
        manifest = imported.get(key)
        location = store.document_location(bucket_manifest_name(key)) if manifest else None
        row = ctx.bucket_row(key, inputs[key], max_attempts=max_attempts, manifest=manifest,
                             manifest_uri=location)
        bucket_id = insert_ignore(session, BucketCompile, row, ["key"])
        bucket = session.scalars(select(BucketCompile).where(BucketCompile.key == key).with_for_update()).one()
        if bucket_id is not None:
            events.record(session, "bucket", bucket.id, None, bucket.state,
                          source="store" if manifest else "submit")
            if bucket.state == BucketState.QUEUED:
                outbox_ids.append(enqueue_compile(session, bucket).id)
                queued.add(bucket.id)
        elif will_compile(bucket.state, bucket.error_class):
            outbox_ids.append(requeue_bucket(session, bucket, "resubmitted", reset_attempts=True,
                                             model=ctx.model_row))
            queued.add(bucket.id)
        session.add(ArtifactBucket(artifact_id=artifact.id, bucket_compile_id=bucket.id,
                                   position=positions[key]))
    session.flush()
    return outbox_ids


def reopen(session: Session, artifact: Artifact, ctx: SubmitContext, queued: set[int]) -> list[int]:
    """Build a failed, cancelled or deleted set again: requeue what will compile, unless a bucket failed for
    good (the negative cache). Returns the outbox ids; adds the requeued compiles to ``queued``."""
    buckets = linked_buckets(session, artifact.id)
    failed = [b for b in buckets if failed_for_good(b.state, b.error_class)]
    if failed:
        # The negative cache: the set stays failed until an explicit retry. One that was cancelled meanwhile
        # (a bucket it shares with another set failed there) is failed now, so the new build says why.
        if artifact.state == ArtifactState.CANCELLED:
            fail_artifacts_of_bucket(session, failed[0], also_cancelled=True)
        return []
    outbox_ids = []
    for bucket in buckets:
        if will_compile(bucket.state, bucket.error_class):
            outbox_ids.append(requeue_bucket(session, bucket, "resubmitted", reset_attempts=True,
                                             model=ctx.model_row))
            queued.add(bucket.id)
        elif bucket.state == BucketState.RUNNING and bucket.cancel_requested:
            bucket.cancel_requested = False  # still running: let it finish for the new build
    set_artifact_state(session, artifact, ArtifactState.BUILDING, reason="resubmitted")
    return outbox_ids


def settle(session: Session, artifact: Artifact) -> None:
    """A set containing a bucket that already failed for good (a compile error, a rejected flag) fails at once."""
    if artifact.state != ArtifactState.BUILDING:
        return
    for bucket in linked_buckets(session, artifact.id):
        if failed_for_good(bucket.state, bucket.error_class):
            fail_artifacts_of_bucket(session, bucket)
            return
