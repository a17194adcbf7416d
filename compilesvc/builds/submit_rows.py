"""What one submit writes: the artifact, bucket compile and build rows of a spec whose model is pinned and
whose keys are computed (:class:`SubmitContext`). The decisions (hit, join or new; which compiles to queue)
are :mod:`compilesvc.builds.submit`'s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from compilesvc.access.tokens import Principal
from compilesvc.builds.provenance import counts
from compilesvc.dispatch.routing import queue_name
from compilesvc.ledger.build_records import BuildRecord
from compilesvc.ledger.models import utcnow
from compilesvc.pinning.pins import PinnedModel
from compilesvc.spec.compile_spec import CompileSpec
from compilesvc.spec.keys import KeySet
from compilesvc.spec.manifest import BucketManifest
from compilesvc.states import BUILD_STATE_FOR_ARTIFACT, ArtifactState, BucketState


@dataclass(frozen=True)
class SubmitContext:
    """One submit: the spec, its pinned model and keys, and who asked; builds the rows it writes."""

    spec: CompileSpec
    pinned: PinnedModel
    keys: KeySet
    principal: Principal | None
    idempotency_key: str | None
    request_hash: str
    callbacks: tuple[str, ...] = ()  # the spec's and the team's webhook URLs
    #: The build's team when it is not the principal's: a roll-forward's build is the source build's team's (whose
    #: model sources were checked), whoever started the campaign (a policy has no principal; an admin another team).
    team: str | None = None

    @property
    def build_team(self) -> str | None:
        return self.team if self.team is not None else self.principal.team if self.principal else None

    @property
    def model_row(self) -> dict[str, Any]:
        """The pinned model as a bucket compile records it (what the worker fetches)."""
        pinned = self.pinned
        return {"uri": pinned.uri, "format": pinned.format, "sha256": pinned.sha256, "size": pinned.size,
                "fetch": pinned.fetch}

    @property
    def queue(self) -> str:
        return queue_name(self.spec.target, self.spec.sdk, self.spec.backend,
                          self.keys.material["toolchain"].get("isa"), self.spec.compiler.tp_degree)

    def artifact_row(self, state: str) -> dict[str, Any]:
        now = utcnow()
        return {"key": self.keys.key, "state": state, "target": self.spec.target, "sdk": self.spec.sdk,
                "backend": self.spec.backend, "model_sha256": self.pinned.sha256, "material": self.keys.material,
                "components": self.keys.components, "created_at": now, "updated_at": now}

    def bucket_row(self, key: str, inputs: list[dict[str, Any]], *, max_attempts: int,
                   manifest: BucketManifest | None, manifest_uri: str | None) -> dict[str, Any]:
        """A new bucket compile: queued, or succeeded already when its manifest was found in the store."""
        now = utcnow()
        row: dict[str, Any] = {
            "key": key, "state": BucketState.QUEUED, "target": self.spec.target, "sdk": self.spec.sdk,
            "backend": self.spec.backend, "queue": self.queue,
            "model": self.model_row,
            "material": self.keys.material, "inputs": inputs, "attempts": 0,
            "max_attempts": max_attempts, "lease_token": 0, "cancel_requested": False,
            "queued_at": now, "updated_at": now,
        }
        if manifest is not None:
            row.update(state=BucketState.SUCCEEDED, manifest_uri=manifest_uri, versions=manifest.versions,
                       compile_seconds=manifest.compile_seconds, finished_at=now)
        return row

    def build_record(self, artifact_id: int, artifact_key: str, artifact_state: str, outcome: str, *,
                     provenance: dict[str, dict[str, Any]] | None = None) -> BuildRecord:
        """The build row; ``provenance`` is how it got each bucket (:mod:`compilesvc.builds.provenance`), None for a
        hit, which reused every one of them."""
        now = utcnow()
        principal = self.principal
        row = {
            "artifact_id": artifact_id, "artifact_key": artifact_key,
            "state": BUILD_STATE_FOR_ARTIFACT[artifact_state], "outcome": outcome,
            "submitted_by": principal.owner if principal else None,
            "token_id": principal.token_id if principal else None, "team": self.build_team,
            "labels": dict(self.spec.labels),
            "spec": self.spec.document, "model_name": self.spec.model.name,
            "model_sha256": self.pinned.sha256, "target": self.spec.target, "sdk": self.spec.sdk,
            "backend": self.spec.backend, "idempotency_key": self.idempotency_key,
            "request_hash": self.request_hash, "created_at": now,
            "finished_at": now if artifact_state != ArtifactState.BUILDING else None,
            "provenance": provenance,
        }
        row["buckets_reused"], row["buckets_compiled"] = (
            (len(self.keys.bucket_keys), 0) if provenance is None else counts(provenance))
        return BuildRecord(row=row, labels=dict(self.spec.labels), detail={"outcome": outcome},
                           callbacks=self.callbacks)
