"""Submit: turn a spec into a hit, a join or a new build, deduplicated against the ledger and the store.

One call (:meth:`Submitter.submit`) decides:

- **hit**: the artifact is published in the ledger, or its manifest is in the store (imported on sight);
- **join**: the same artifact is already in flight (or failed with a compile error or a rejected flag: the
  negative cache);
- **new**: an artifact row is created and only the bucket compiles that do not exist yet (or whose last
  attempt failed for infrastructure reasons, or was cancelled) are queued, so adding one bucket to a
  built set compiles one bucket.

Atomicity comes from unique keys: ``INSERT … ON CONFLICT DO NOTHING RETURNING id`` on the artifact key and
on each bucket key, in sorted key order so concurrent submits never deadlock. Dispatch messages go into
the outbox in the same transaction and are relayed only after commit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from sqlalchemy import select
from sqlalchemy.orm import Session

from compilesvc.access import idempotency
from compilesvc.access.tokens import Principal
from compilesvc.builds import provenance, set_changes
from compilesvc.builds.admission import admit
from compilesvc.builds.joins import InFlight, join_batch
from compilesvc.builds.store_imports import bucket_manifests_of, importable_buckets
from compilesvc.builds.submit_rows import SubmitContext
from compilesvc.compiles.bucket_compiles import BucketView, bucket_views, positioned_buckets, views_of
from compilesvc.compiles.publishing import publish_if_complete
from compilesvc.ledger import events
from compilesvc.ledger.build_records import BuildRecord, insert_build_details, insert_builds
from compilesvc.ledger.engine import transaction
from compilesvc.ledger.models import Artifact, Build, utcnow
from compilesvc.ledger.sql import insert_ignore
from compilesvc.lifecycle.artifacts import (
    PublishedManifests,
    StoreManifests,
    read_manifest,
)
from compilesvc.notify.webhooks import check_callbacks
from compilesvc.pinning.checkpoints import check_architecture
from compilesvc.pinning.model_sources import check_model_source
from compilesvc.pinning.pins import ModelRefError, PinnedModel
from compilesvc.services import Services
from compilesvc.spec.compile_spec import CompileSpec
from compilesvc.spec.keys import KeySet, compute_keys, digest, presharded
from compilesvc.spec.manifest import ArtifactManifest, BucketManifest
from compilesvc.spec.nxdi_config import NeuronConfigError
from compilesvc.states import (
    BUILD_STATE_FOR_ARTIFACT,
    ArtifactState,
    BucketState,
    Outcome,
    failed_for_good,
)
from compilesvc.store.base import artifact_manifest_name

log = logging.getLogger(__name__)

_PUBLISHED_IDS_MAX = 100_000
#: How long an artifact seen published is answered as a hit without asking the ledger again. Retention
#: can delete a published artifact; it waits longer than this before removing files (``gc_grace_seconds``).
PUBLISHED_TRUST_SECONDS = 60.0


@dataclass(frozen=True)
class Prepared:
    """A spec with its model pinned and its keys computed (:meth:`Submitter.prepare`)."""

    spec: CompileSpec
    pinned: PinnedModel
    keys: KeySet
    request_hash: str
    #: The team whose model sources the spec's model was checked against (:mod:`compilesvc.pinning.model_sources`;
    #: None: no team, ``"*"`` only).
    team: str | None = None

    @property
    def reusable(self) -> bool:
        """Whether it holds for every later identical spec: a blob: URI names the model's content, which
        can neither change nor vanish. s3:// and file:// models are pinned afresh at every submit."""
        return self.spec.model.uri.startswith("blob:")


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


class Submitter:
    """The submit service. Thread-safe; one per process is enough."""

    def __init__(self, services: Services, *, manifests: PublishedManifests | None = None):
        self.services = services
        # Not `manifests or ...`: an empty cache has a length of 0, and a cache that is empty at start is
        # the normal case.
        self.manifests = manifests if manifests is not None else StoreManifests(services.store)
        self.settings = services.settings
        # An artifact seen published stays so until retention deletes it, so its id is trusted for
        # PUBLISHED_TRUST_SECONDS: a cache-hit submit is then one write transaction. Bounded by clearing,
        # wholesale, when full or that old (ids are cheap to re-read).
        self._published_ids: dict[str, int] = {}
        self._published_ids_until = time.monotonic() + PUBLISHED_TRUST_SECONDS
        #: Identical submits in flight together: one runs, the others wait and join at once.
        self.in_flight: InFlight[SubmitResult] = InFlight(self._join_together)

    # -- public -------------------------------------------------------------------------------------

    def keys_for(self, spec: CompileSpec, reuse: PinnedModel | None = None, *, team: str | None = None
                 ) -> tuple[PinnedModel, KeySet]:
        """The spec's model pinned and its keys. An hf-checkpoint is pinned with its config.json (and its weights'
        digests when the compile pre-shards them); one NxDI cannot compile is a :class:`ModelRefError` (a 422).

        ``team``: whose model sources the model must be among (None: a request without a team, ``"*"`` only),
        checked before anything is read (:func:`~compilesvc.pinning.model_sources.check_model_source`), a reused
        pin included: the worker reads its source with the service's role all the same.

        ``reuse``: an earlier build's pin of the same model (a roll-forward resubmits the same bytes: an S3
        prefix's object versions, not what the prefix holds today), used instead of pinning again when it still
        holds and has what the key needs; the architecture is checked against ``spec``'s release all the same."""
        check_model_source(self.settings, team, spec.model)
        try:
            weight_digests = spec.backend == "nxdi" and presharded(spec)
        except NeuronConfigError as exc:  # (the spec's own validation reports these first)
            raise ModelRefError(exc.message, field=".".join(["neuron_config", *map(str, exc.field)])) from None
        pinned = self._reused(spec, reuse, weight_digests) if reuse is not None else None
        if pinned is None:
            pinned = self.services.resolver.pin(spec.model, weight_digests=weight_digests, sdk=spec.sdk)
        if pinned.checkpoint is not None:
            check_architecture(spec.sdk, pinned.checkpoint)
        keys = compute_keys(spec, model_sha256=pinned.sha256, default_isa=self.services.default_isa,
                            salt=self.settings.key_salt, checkpoint=pinned.checkpoint)
        return pinned, keys

    def _reused(self, spec: CompileSpec, reuse: PinnedModel, weight_digests: bool) -> PinnedModel | None:
        """``reuse`` if it can stand for ``spec``'s model; None to pin afresh (a content-addressed blob: the same
        bytes whichever way). A pin lacking the weights' digests a pre-sharding release needs cannot be completed
        without reading the source again, which may hold other bytes by now: a refusal."""
        if (reuse.uri, reuse.format) != (spec.model.uri, spec.model.format):
            raise ValueError(f"a pin of {reuse.uri} ({reuse.format}) cannot stand for {spec.model.uri}")
        blob = reuse.fetch.get("kind") == "blob"
        if blob and (self.services.store is None or self.services.store.blob_size(reuse.sha256) is None):
            return None  # gone from the store: pinning says so in its own words
        if weight_digests and reuse.checkpoint is not None and reuse.checkpoint.weights is None:
            if blob:
                return None
            raise ModelRefError(f"the earlier build pinned {reuse.uri} without its weights' digests, which "
                                f"{spec.sdk}'s NeuronConfig (pre-sharded weights) puts in the key; submit the spec "
                                "again to pin the checkpoint as it is now")
        return reuse

    def prepare(self, spec: CompileSpec, reuse: PinnedModel | None = None, *, team: str | None = None) -> Prepared:
        """Everything about a submit of ``spec`` that reads no ledger: its model checked for ``team`` and pinned (or
        ``reuse``d: :meth:`keys_for`), its keys."""
        pinned, keys = self.keys_for(spec, reuse, team=team)
        return Prepared(spec, pinned, keys, digest(spec.model_dump(mode="json")), team)

    def checked_for(self, prepared: Prepared, team: str | None) -> Prepared:
        """``prepared`` (kept from another request) for a submit of ``team``: its model checked for that team."""
        if prepared.team == team:
            return prepared
        check_model_source(self.settings, team, prepared.spec.model)
        return replace(prepared, team=team)

    def submit(self, spec: CompileSpec | Prepared, *, principal: Principal | None = None,
               idempotency_key: str | None = None, queue_anyway: bool = False) -> SubmitResult:
        """Submit ``spec``, or a prepared one (:meth:`prepare`; a caller may keep one while it is
        :attr:`Prepared.reusable`), for ``principal`` (recorded as the build's submitter and team). A spec is
        prepared for the principal's team; a prepared one was checked for the team its preparer chose
        (:meth:`checked_for`).

        An ``idempotency_key`` is the principal's own (Stripe's semantics): the same key with the same spec
        within ``idempotency_key_seconds`` replays the first answer; with another spec it is refused
        (:class:`IdempotencyConflict`); after that it is a new key."""
        request_hash = spec.request_hash if isinstance(spec, Prepared) else digest(spec.model_dump(mode="json"))
        if idempotency_key and principal is None:
            raise ValueError("an Idempotency-Key belongs to a token: pass the principal")
        if idempotency_key:  # a replay answers before the model is pinned again, as it was first answered
            replay = self._replay(principal, idempotency_key, request_hash)
            if replay is not None:
                return replay
        prepared = spec if isinstance(spec, Prepared) else self.prepare(
            spec, team=principal.team if principal is not None else None)
        keys = prepared.keys
        check_callbacks(prepared.spec.callbacks, self.settings.webhook_networks)
        team_urls = self.settings.team_webhooks.get(principal.team, []) if principal is not None else []
        context = SubmitContext(prepared.spec, prepared.pinned, keys, principal, idempotency_key, request_hash,
                                tuple(dict.fromkeys([*prepared.spec.callbacks, *team_urls])))
        if idempotency_key or context.callbacks or keys.key in self._published_ids:
            return self._submit_alone(context, queue_anyway)  # a key or webhooks each; a hit group-commits
        joined = self.in_flight.submit(context, lambda committed: self._lead(context, queue_anyway, committed))
        return joined if joined is not None else self._submit_alone(context, queue_anyway)

    def _lead(self, context: SubmitContext, queue_anyway: bool, committed: Callable[[], None]) -> SubmitResult:
        """The first of identical submits in flight together (:mod:`compilesvc.builds.joins`): a set seen in flight
        lately is joined at once, as its followers will be; otherwise the submit decides alone."""
        if self.in_flight.seen_in_flight(context.keys.key):
            joined = self._join_together([context])
            if joined is not None:
                return joined[0]
        result = self._submit_alone(context, queue_anyway, committed)
        if result.artifact_state == ArtifactState.BUILDING:
            self.in_flight.saw_in_flight(result.artifact_key)
        return result

    # -- steps --------------------------------------------------------------------------------------

    def _submit_alone(self, context: SubmitContext, queue_anyway: bool,
                      committed: Callable[[], None] | None = None) -> SubmitResult:
        """One submit, deciding hit, join or new for itself; ``committed`` is called once its build is."""
        principal, idempotency_key, request_hash = context.principal, context.idempotency_key, context.request_hash
        seen: str | None = None  # the set's state in the ledger, when it has the set
        try:
            hit, seen = self._published_hit(context)
        except _IdempotencyRace:
            hit = self._replay(principal, idempotency_key or "", request_hash)
        if hit is not None:
            return hit
        # A set in flight has every bucket in the ledger, and joining it queues nothing: neither the store
        # nor admission has a say. Should it turn out to need either, the join is run again admitted.
        in_flight = seen == ArtifactState.BUILDING
        imported = None if in_flight else self._admitted(context, queue_anyway)
        try:
            try:
                # A set seen finished (failed, cancelled, deleted) is reopened: exclusively from the start.
                result, outbox_ids, finalize = self._create_or_join(
                    context, imported, exclusive=seen is not None and not in_flight)
            except _NeedsExclusive:
                imported = imported if imported is not None else self._admitted(context, queue_anyway)
                result, outbox_ids, finalize = self._create_or_join(context, imported, exclusive=True)
        except _IdempotencyRace:  # an identical request with the same key committed first
            replay = self._replay(principal, idempotency_key or "", request_hash)
            if replay is None:
                raise RuntimeError("idempotency key vanished after a conflict") from None
            return replay
        if committed is not None:
            committed()
        self._after_commit(outbox_ids, finalize, result)
        if result.outcome == Outcome.NEW or finalize:
            return self._reload(result)  # a new set's compiles may have moved since
        # A join's answer was read under the set's lock and is current; a hit's manifest is read now, with no
        # lock held (the store may be a network call away).
        return replace(result, manifest=self._manifest_of(result.artifact_key, result.artifact_state))

    def _join_together(self, contexts: list[SubmitContext]) -> list[SubmitResult] | None:
        """Identical submits that waited for one in flight (:mod:`compilesvc.builds.joins`), joined at once."""
        joined = join_batch(self.services.sessions, contexts)
        if joined is None:
            return None
        return [SubmitResult(build_id=build_id, outcome=Outcome.JOIN, state=joined.state,
                             artifact_key=contexts[0].keys.key, artifact_state=joined.artifact_state,
                             buckets=joined.buckets) for build_id in joined.build_ids]

    def _replay(self, principal: Principal | None, idempotency_key: str, request_hash: str) -> SubmitResult | None:
        """The first answer to this principal's key (its build as it is now, and the status first answered)."""
        if principal is None:
            return None
        with self.services.sessions() as session:
            first = idempotency.find(session, principal.token_id, idempotency_key, request_hash,
                                     self.settings.idempotency_key_seconds)
            if first is None:
                return None
            build = session.get_one(Build, first.build_id)
            artifact = session.get_one(Artifact, build.artifact_id)
            return SubmitResult(build_id=build.id, outcome=build.outcome, state=build.state,
                                artifact_key=artifact.key, artifact_state=artifact.state,
                                buckets=bucket_views(session, artifact.id), replayed=True,
                                manifest=self._manifest_of(artifact.key, artifact.state), first_status=first.status)

    def _admitted(self, ctx: SubmitContext, queue_anyway: bool) -> dict[str, BucketManifest]:
        """The buckets the store has (:func:`~compilesvc.builds.store_imports.importable_buckets`), once the
        submit is admitted."""
        imported = importable_buckets(self.services, ctx.keys)
        with self.services.sessions() as session:
            admit(session, self.settings, ctx, set(imported), queue_anyway)
        return imported

    def _published_hit(self, ctx: SubmitContext) -> tuple[SubmitResult | None, str | None]:
        """The fast path: no read once an artifact was seen published, and the build is group-committed
        with concurrent submits (:mod:`compilesvc.ledger.build_records`). Falls back to importing a manifest
        found in the store. Also says the set's state when the ledger has it and it is not published."""
        key = ctx.keys.key
        if time.monotonic() > self._published_ids_until:
            self._published_ids.clear()
            self._published_ids_until = time.monotonic() + PUBLISHED_TRUST_SECONDS
        artifact_id = self._published_ids.get(key)
        if artifact_id is None:
            with self.services.sessions() as session:
                found = session.execute(select(Artifact.id, Artifact.state).where(Artifact.key == key)).one_or_none()
            if found is None:
                manifest = read_manifest(self.services.store, key)
                return (self._import_artifact(ctx, manifest) if manifest is not None else None), None
            if found.state != ArtifactState.PUBLISHED:
                return None, found.state
            artifact_id = found.id
            if len(self._published_ids) >= _PUBLISHED_IDS_MAX:
                self._published_ids.clear()
            self._published_ids[key] = artifact_id
        record = ctx.build_record(artifact_id, key, ArtifactState.PUBLISHED, Outcome.HIT)
        if ctx.idempotency_key or ctx.callbacks:  # its key and its webhooks go in a transaction of its own
            with transaction(self.services.sessions) as session:
                build_id = self._require_build(self._add_build(session, ctx, record))
        else:
            build_id = self.services.build_recorder.record(record)
        return SubmitResult(build_id=build_id, outcome=Outcome.HIT, state=record.row["state"], artifact_key=key,
                            artifact_state=ArtifactState.PUBLISHED, buckets=[],
                            manifest=self.manifests.published_manifest(key)), None

    def _import_artifact(self, ctx: SubmitContext, manifest: ArtifactManifest) -> SubmitResult:
        """A manifest in the store but not in the ledger (another region, a rebuilt ledger): record it."""
        imported = bucket_manifests_of(manifest)
        with transaction(self.services.sessions) as session:
            artifact_id = insert_ignore(session, Artifact, ctx.artifact_row(ArtifactState.PUBLISHED), ["key"])
            artifact = session.scalars(select(Artifact).where(Artifact.key == ctx.keys.key).with_for_update()).one()
            if artifact_id is not None:
                artifact.manifest_uri = self.services.store.document_location(artifact_manifest_name(ctx.keys.key))
                artifact.size_bytes = manifest.size_bytes
                artifact.published_at = utcnow()
                events.record(session, "artifact", artifact.id, None, ArtifactState.PUBLISHED, source="store")
                set_changes.link_buckets(session, self.services.store, self.settings.max_attempts, ctx, artifact,
                                         imported, set())
            build_id = self._require_build(self._add_build(
                session, ctx, ctx.build_record(artifact.id, artifact.key, artifact.state, Outcome.HIT)))
            return SubmitResult(build_id=build_id, outcome=Outcome.HIT, state=BUILD_STATE_FOR_ARTIFACT[artifact.state],
                                artifact_key=artifact.key, artifact_state=artifact.state, buckets=[],
                                manifest=manifest)

    def _create_or_join(self, ctx: SubmitContext, imported: dict[str, BucketManifest] | None, *, exclusive: bool
                        ) -> tuple[SubmitResult, list[int], bool]:
        """Create the set or join it, in one transaction holding the artifact row's lock: exclusively when
        this submit creates or changes the set (a reopen, a set failing for a remembered failure), shared
        when it only adds a build to it (a join, a hit), so that a burst of identical submits joins in
        parallel rather than one by one. Finishing workers, cancels and reopening submits lock the row
        exclusively: they wait for the joins in progress and see their builds. A submit that holds the
        shared lock and finds it must change the set raises :class:`_NeedsExclusive` (its transaction is
        rolled back) and is run again with ``exclusive``: upgrading a shared lock in place would deadlock
        with another submit doing the same. So does a submit not admitted (``imported`` None: it expected a
        set in flight) that finds it must create the set."""
        outbox_ids: list[int] = []
        with transaction(self.services.sessions) as session:
            artifact_id = insert_ignore(session, Artifact, ctx.artifact_row(ArtifactState.BUILDING), ["key"])
            if imported is None and artifact_id is not None:
                raise _NeedsExclusive
            shared = artifact_id is None and not exclusive
            artifact = session.scalars(select(Artifact).where(Artifact.key == ctx.keys.key)
                                       .with_for_update(read=shared)).one()
            if shared and artifact.state not in (ArtifactState.BUILDING, ArtifactState.PUBLISHED):
                raise _NeedsExclusive
            queued: set[int] = set()  # the compiles this submit queues: this build's own
            if artifact_id is not None:
                outcome = Outcome.NEW
                events.record(session, "artifact", artifact.id, None, ArtifactState.BUILDING)
                outbox_ids = set_changes.link_buckets(session, self.services.store, self.settings.max_attempts,
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
                raise _NeedsExclusive  # the set fails for it (set_changes.settle), which changes the set
            got = provenance.at_submit((bucket for bucket, _ in positioned), queued)
            build_id = self._add_build(
                session, ctx, ctx.build_record(artifact.id, artifact.key, artifact.state, outcome, provenance=got))
            if build_id is None:
                raise _IdempotencyRace  # rolls the whole transaction back
            provenance.record_origin(session, build_id, ctx.spec.model.name, sorted(queued))
            # A new set's answer is read again after commit (states only here, for `finalize`); a join's is
            # this one, with each bucket's failures (its manifest, if published, is read after commit).
            result = SubmitResult(build_id=build_id, outcome=outcome, state=BUILD_STATE_FOR_ARTIFACT[artifact.state],
                                  artifact_key=artifact.key, artifact_state=artifact.state,
                                  buckets=views_of(session, positioned, history=outcome != Outcome.NEW))
            finalize = artifact.state == ArtifactState.BUILDING and all(b.state == BucketState.SUCCEEDED
                                                                       for b in result.buckets)
        return result, outbox_ids, finalize

    def _after_commit(self, outbox_ids: list[int], finalize: bool, result: SubmitResult) -> None:
        self.services.relay.after_commit(outbox_ids, build_id=result.build_id)
        if finalize:
            with self.services.sessions() as session:
                artifact_id = session.scalars(select(Artifact.id).where(Artifact.key == result.artifact_key)).one()
            publish_if_complete(self.services.store, self.services.sessions, artifact_id,
                                signer=self.services.signer)

    def _reload(self, result: SubmitResult) -> SubmitResult:
        with self.services.sessions() as session:
            build = session.get_one(Build, result.build_id)
            artifact = session.get_one(Artifact, build.artifact_id)
            return SubmitResult(build_id=build.id, outcome=result.outcome, state=build.state,
                                artifact_key=artifact.key, artifact_state=artifact.state,
                                buckets=bucket_views(session, artifact.id),
                                manifest=self._manifest_of(artifact.key, artifact.state))

    @staticmethod
    def _require_build(build_id: int | None) -> int:
        if build_id is None:
            raise _IdempotencyRace
        return build_id

    # -- rows ---------------------------------------------------------------------------------------

    def _manifest_of(self, key: str, state: str) -> ArtifactManifest | None:
        return self.manifests.published_manifest(key) if state == ArtifactState.PUBLISHED else None

    def _add_build(self, session: Session, ctx: SubmitContext, record: BuildRecord) -> int | None:
        """Record one submission in ``session``'s transaction; None when its Idempotency-Key was taken
        meanwhile (the caller rolls back and replays)."""
        [build_id] = insert_builds(session.connection(), [record])
        if ctx.idempotency_key and ctx.principal is not None:
            status = 200 if record.row["outcome"] == Outcome.HIT else 202  # as web.api.builds answers
            if not idempotency.claim(session, ctx.principal.token_id, ctx.idempotency_key, ctx.request_hash,
                                     build_id, status, self.settings.idempotency_key_seconds):
                return None
        # Its creation event tells the subscribers: its callbacks are recorded, and notified if it is born ended.
        insert_build_details(session, [record], [build_id])
        return build_id


class _IdempotencyRace(Exception):
    """Another request with the same Idempotency-Key committed between our check and our insert."""


class _NeedsExclusive(Exception):
    """A submit holding the set's shared lock found it must change the set (see ``_create_or_join``)."""


