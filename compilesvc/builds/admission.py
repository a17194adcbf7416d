"""Whether a submit may start compiles: a live worker must serve its queue, and its token must stay within
its compile quota. Both are checked before anything is written (:func:`admit`), and neither applies to a
submit that starts no compile (a hit, a join, a set of buckets compiled already). A refusal for want of a
worker says why where the queue needs a particular host (a trace compile of a release before SDK 2.21.0
needs a Neuron device: :func:`compilesvc.spec.neuron_kinds.device_requirement`).

The quota: a compile takes a worker slot for minutes to hours, so one pipeline in a loop must not be able
to fill every queue. It counts the distinct bucket compiles of the token's builds that are still building,
which are queued or running; admin tokens have none. It is a soft bound: two submits at the same instant
may both pass it.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from compilesvc.access.tokens import Principal
from compilesvc.builds.submit_rows import SubmitContext
from compilesvc.config.settings import Settings
from compilesvc.dispatch.registry import served_queues
from compilesvc.ledger.models import ArtifactBucket, BucketCompile, Build
from compilesvc.refusals import NoCapableWorker, SubmitRefused
from compilesvc.spec.neuron_kinds import device_requirement
from compilesvc.states import REQUEUED_BY_SUBMIT, BucketState, BuildState


class QuotaExceeded(SubmitRefused):
    """The token has as many compiles in flight as it may: retry once some finish (429)."""

    status = 429
    code = "quota-exceeded"

    def __init__(self, message: str, *, in_flight: int, needed: int, limit: int):
        self.in_flight, self.needed, self.limit = in_flight, needed, limit
        super().__init__(message)


class SpecOverQuota(SubmitRefused):
    """The spec alone needs more compiles than the token may ever run at once (422: retrying cannot help)."""

    status = 422
    code = "spec-over-quota"


def compiles_in_flight(session: Session, token_id: int) -> int:
    """Distinct bucket compiles, queued or running, of the token's builds that are still building."""
    query = (
        select(func.count(func.distinct(BucketCompile.id)))
        .select_from(Build)
        .join(ArtifactBucket, ArtifactBucket.artifact_id == Build.artifact_id)
        .join(BucketCompile, BucketCompile.id == ArtifactBucket.bucket_compile_id)
        .where(Build.token_id == token_id, Build.state == BuildState.BUILDING,
               BucketCompile.state.in_((BucketState.QUEUED, BucketState.RUNNING)))
    )
    return int(session.scalar(query) or 0)


def check_compile_quota(session: Session, principal: Principal | None, needed: int, limit: int) -> None:
    """Refuse a submit that would start ``needed`` compiles for ``principal`` past ``limit`` (0: no quota)."""
    if principal is None or principal.is_admin or limit <= 0 or needed == 0:
        return
    if needed > limit:
        raise SpecOverQuota(f"this spec needs {needed} bucket compiles; a token may have at most {limit} queued "
                            "or running at once (split the spec, or ask an admin to raise "
                            "COMPILESVC_MAX_COMPILES_PER_TOKEN)")
    in_flight = compiles_in_flight(session, principal.token_id)
    if in_flight + needed > limit:
        raise QuotaExceeded(f"token {principal.name!r} has {in_flight} bucket compiles queued or running and this "
                            f"spec needs {needed} more; at most {limit} at once: retry when some finish",
                            in_flight=in_flight, needed=needed, limit=limit)


def will_compile(state: str | None, error_class: str | None) -> bool:
    """Whether a submit finding a bucket compile in this state queues it (None: no such compile yet).

    A compile error or a rejected flag is answered from the negative cache: no worker is needed to say it
    again.
    """
    if state == BucketState.FAILED:
        return error_class in REQUEUED_BY_SUBMIT
    return state in (None, BucketState.CANCELLED, BucketState.DELETED)


def admit(session: Session, settings: Settings, ctx: SubmitContext, imported: set[str], queue_anyway: bool) -> None:
    """Refuse a submit that would queue compiles no live worker, nor a pool that scales from zero, serves
    (:class:`NoCapableWorker`, unless ``queue_anyway``), or past its token's quota. ``imported``: bucket keys
    whose manifests the store has."""
    check_workers = settings.require_live_worker and not queue_anyway
    if not check_workers and (ctx.principal is None or not settings.max_compiles_per_token):
        return
    rows = session.execute(
        select(BucketCompile.key, BucketCompile.state, BucketCompile.error_class)
        .where(BucketCompile.key.in_(ctx.keys.bucket_keys))
    ).all()
    known = {key: (state, error_class) for key, state, error_class in rows}
    needed = sum(1 for key in set(ctx.keys.bucket_keys)
                 if key not in imported and will_compile(*known.get(key, (None, None))))
    if needed and check_workers and ctx.queue not in served_queues(session, settings.worker_stale_seconds,
                                                                   settings.scalable_queue_names):
        reason = None
        if ctx.spec.target != "cpu":  # only workers with a device consume such a queue (workers.host.versions)
            reason = device_requirement(ctx.spec.sdk, ctx.spec.backend, ctx.spec.compiler.tp_degree)
        raise NoCapableWorker(ctx.queue, ctx.spec.target, ctx.spec.sdk, reason)
    check_compile_quota(session, ctx.principal, needed, settings.max_compiles_per_token)
