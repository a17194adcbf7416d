"""Per-token compile quota: how many bucket compiles one token may have queued or running at once.

A compile takes a worker slot for minutes to hours, so one pipeline in a loop must not be able to fill
every queue. The quota counts the distinct bucket compiles of the token's builds that are still building,
which are queued or running; a submit that would take the token past it is refused before anything is
written. Hits and joins add no compile and are never refused; admin tokens have no quota.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from compilesvc.ledger.models import ArtifactBucket, BucketCompile, Build
from compilesvc.refusals import SubmitRefused
from compilesvc.states import BucketState, BuildState
from compilesvc.tokens import Principal


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
