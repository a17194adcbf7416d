"""Operator and client control of builds: cancel and retry.

Cancel is cooperative. A build is cancelled at once; its artifact only when no other build still waits
for it; a bucket compile only when no other building set contains it. Queued compiles are cancelled in
the ledger (their message finds nothing to claim); running ones get ``cancel_requested``, which the
worker's lease heartbeat sees, and it ends the compiler's whole process group.

Retry puts failed and cancelled bucket compiles back in the queue with fresh attempts, clearing the
negative cache for those keys.

Both are for the submitting team's tokens and admins: given the caller's ``principal``, a build of
another team is refused (:class:`NotYourBuild`) in the transaction that locks it. Without one (the
service's own callers, tests) nothing is checked.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from compilesvc.access.tokens import Principal
from compilesvc.builds import provenance
from compilesvc.compiles.bucket_compiles import linked_buckets, requeue_bucket
from compilesvc.ledger import events
from compilesvc.ledger.engine import transaction
from compilesvc.ledger.models import Artifact, ArtifactBucket, BucketCompile, Build, utcnow
from compilesvc.lifecycle.artifacts import set_artifact_state
from compilesvc.refusals import NotCancellable, NotRetryable, NotYourBuild
from compilesvc.services import Services
from compilesvc.states import ArtifactState, BucketState, BuildState, ErrorClass


class BuildNotFound(LookupError):
    def __init__(self, build_id: int):
        super().__init__(f"no build {build_id}")


def _needed_elsewhere(session: Session, bucket: BucketCompile, artifact_id: int) -> bool:
    other = session.scalar(
        select(Artifact.id)
        .join(ArtifactBucket, ArtifactBucket.artifact_id == Artifact.id)
        .where(ArtifactBucket.bucket_compile_id == bucket.id, Artifact.id != artifact_id,
               Artifact.state == ArtifactState.BUILDING)
        .limit(1)
    )
    return other is not None


def _locked_build(session: Session, build_id: int, principal: Principal | None) -> tuple[Build, Artifact]:
    build = session.get(Build, build_id)
    if build is None:
        raise BuildNotFound(build_id)
    if principal is not None and not principal.may_control(build.team):
        raise NotYourBuild(build_id, build.team)
    # Lock order everywhere: artifact first, then its buckets.
    artifact = session.get_one(Artifact, build.artifact_id, with_for_update=True)
    session.refresh(build, with_for_update=True)
    return build, artifact


def cancel_build(services: Services, build_id: int, principal: Principal | None = None) -> None:
    with transaction(services.sessions) as session:
        build, artifact = _locked_build(session, build_id, principal)
        if build.state != BuildState.BUILDING:
            raise NotCancellable(f"build {build_id} is already {build.state}")
        events.record(session, "build", build.id, build.state, BuildState.CANCELLED, reason="cancel requested")
        build.state = BuildState.CANCELLED
        build.finished_at = utcnow()
        still_waiting = session.scalar(
            select(Build.id).where(Build.artifact_id == artifact.id, Build.state == BuildState.BUILDING).limit(1)
        )
        if still_waiting is not None:
            return  # another build still wants this artifact
        set_artifact_state(session, artifact, ArtifactState.CANCELLED, reason=f"build {build_id} cancelled")
        for bucket in linked_buckets(session, artifact.id):
            if bucket.state not in (BucketState.QUEUED, BucketState.RUNNING) or \
                    _needed_elsewhere(session, bucket, artifact.id):
                continue
            if bucket.state == BucketState.QUEUED:
                events.record(session, "bucket", bucket.id, BucketState.QUEUED, BucketState.CANCELLED)
                bucket.state = BucketState.CANCELLED
                bucket.error_class = ErrorClass.CANCELLED
                bucket.error_message = f"cancelled with build {build_id} before it started"
                bucket.finished_at = utcnow()
                bucket.lease_token += 1
            else:
                bucket.cancel_requested = True


def retry_build(services: Services, build_id: int, principal: Principal | None = None) -> list[int]:
    """Requeue the failed/cancelled compiles of a build's artifact; returns relayed outbox ids."""
    with transaction(services.sessions) as session:
        build, artifact = _locked_build(session, build_id, principal)
        if artifact.state == ArtifactState.PUBLISHED:
            raise NotRetryable(f"build {build_id}'s artifact is already published; nothing to retry")
        buckets = linked_buckets(session, artifact.id)
        retryable = [b for b in buckets if b.state in (BucketState.FAILED, BucketState.CANCELLED)]
        if not retryable and build.state == BuildState.BUILDING:
            raise NotRetryable(f"build {build_id} is still building and nothing in it failed")
        outbox_ids = [requeue_bucket(session, b, f"retry of build {build_id}", reset_attempts=True)
                      for b in retryable]
        provenance.mark_compiled(session, build, [b.id for b in retryable])
        for bucket in buckets:
            if bucket.state == BucketState.RUNNING and bucket.cancel_requested:
                bucket.cancel_requested = False
        set_artifact_state(session, artifact, ArtifactState.BUILDING, reason=f"retry of build {build_id}")
        if build.state != BuildState.BUILDING:
            events.record(session, "build", build.id, build.state, BuildState.BUILDING, reason="retry")
            build.state = BuildState.BUILDING
            build.finished_at = None
    services.relay.after_commit(outbox_ids, build_id=build_id)
    return outbox_ids
