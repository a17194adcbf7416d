"""A submit's answer (:class:`SubmitResult`: hit, join or new, the build and its set), and the two answers read back
from the ledger: a replay of an Idempotency-Key's first answer, and a new set's build as it is after commit."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.orm import Session, sessionmaker

from compilesvc.access import idempotency
from compilesvc.access.tokens import Principal
from compilesvc.compiles.bucket_compiles import BucketView, bucket_views
from compilesvc.ledger.models import Artifact, Build
from compilesvc.spec.manifest import ArtifactManifest

#: The published manifest of an artifact (key, state), or None when it is not published.
ManifestOf = Callable[[str, str], ArtifactManifest | None]


@dataclass(frozen=True)
class SubmitResult:
    build_id: int
    outcome: str
    state: str
    artifact_key: str
    artifact_state: str
    buckets: list[BucketView]
    replayed: bool = False
    manifest: ArtifactManifest | None = None
    #: A replay's: the HTTP status the first request with its Idempotency-Key was answered with.
    first_status: int | None = None


def replay(sessions: sessionmaker[Session], manifest_of: ManifestOf, principal: Principal | None,
           idempotency_key: str, request_hash: str, key_seconds: int) -> SubmitResult | None:
    """The first answer to this principal's key (its build as it is now, and the status first answered); None when
    the key is not (or no longer) the principal's."""
    if principal is None:
        return None
    with sessions() as session:
        first = idempotency.find(session, principal.token_id, idempotency_key, request_hash, key_seconds)
        if first is None:
            return None
        build = session.get_one(Build, first.build_id)
        artifact = session.get_one(Artifact, build.artifact_id)
        return SubmitResult(build_id=build.id, outcome=build.outcome, state=build.state,
                            artifact_key=artifact.key, artifact_state=artifact.state,
                            buckets=bucket_views(session, artifact.id), replayed=True,
                            manifest=manifest_of(artifact.key, artifact.state), first_status=first.status)


def reload(sessions: sessionmaker[Session], manifest_of: ManifestOf, result: SubmitResult) -> SubmitResult:
    """``result``'s build and set as the ledger has them now (a new set's compiles may have moved since commit)."""
    with sessions() as session:
        build = session.get_one(Build, result.build_id)
        artifact = session.get_one(Artifact, build.artifact_id)
        return SubmitResult(build_id=build.id, outcome=result.outcome, state=build.state,
                            artifact_key=artifact.key, artifact_state=artifact.state,
                            buckets=bucket_views(session, artifact.id),
                            manifest=manifest_of(artifact.key, artifact.state))
