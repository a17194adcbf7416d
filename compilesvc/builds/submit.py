"""Submit: turn a spec into a hit, a join or a new build, deduplicated against the ledger and the store.

One call (:meth:`Submitter.submit`) decides:

- **hit**: the artifact is published in the ledger, or its manifest is in the store (imported on sight);
- **join**: the same artifact is already in flight (or failed with a compile error or a rejected flag: the
  negative cache);
- **new**: an artifact row is created and only the bucket compiles that do not exist yet (or whose last
  attempt failed for infrastructure reasons, or was cancelled) are queued, so adding one bucket to a
  built set compiles one bucket.

The spec is prepared first (:mod:`compilesvc.builds.prepare`: its model checked and pinned, its keys); the ledger is
written in the transactions of :mod:`compilesvc.builds.submit_transactions`; the answer is a
:class:`~compilesvc.builds.submit_results.SubmitResult`. This module decides which path a submit takes: the
published fast path, identical submits joined together (:mod:`compilesvc.builds.joins`), admission, and what runs
after commit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

from sqlalchemy import select

from compilesvc.access.tokens import Principal
from compilesvc.builds import submit_results
from compilesvc.builds.admission import admit
from compilesvc.builds.joins import InFlight, join_batch
from compilesvc.builds.prepare import Prepared, Preparer
from compilesvc.builds.store_imports import importable_buckets
from compilesvc.builds.submit_results import SubmitResult
from compilesvc.builds.submit_rows import SubmitContext
from compilesvc.builds.submit_transactions import (
    IdempotencyRace,
    NeedsExclusive,
    add_build,
    create_or_join,
    import_artifact,
    require_build,
)
from compilesvc.compiles.publishing import publish_if_complete
from compilesvc.ledger.engine import transaction
from compilesvc.ledger.models import Artifact
from compilesvc.lifecycle.artifacts import (
    PublishedManifests,
    StoreManifests,
    read_manifest,
)
from compilesvc.notify.webhooks import check_callbacks
from compilesvc.services import Services
from compilesvc.spec.compile_spec import CompileSpec
from compilesvc.spec.keys import digest
from compilesvc.spec.manifest import ArtifactManifest, BucketManifest
from compilesvc.states import ArtifactState, Outcome

log = logging.getLogger(__name__)

_PUBLISHED_IDS_MAX = 100_000
#: How long an artifact seen published is answered as a hit without asking the ledger again. Retention
#: can delete a published artifact; it waits longer than this before removing files (``gc_grace_seconds``).
PUBLISHED_TRUST_SECONDS = 60.0


class Submitter(Preparer):
    """The submit service: a :class:`~compilesvc.builds.prepare.Preparer` (``keys_for``, ``prepare``,
    ``checked_for``) that also submits. Thread-safe; one per process is enough."""

    def __init__(self, services: Services, *, manifests: PublishedManifests | None = None):
        super().__init__(services)
        # Not `manifests or ...`: an empty cache has a length of 0, and a cache that is empty at start is
        # the normal case.
        self.manifests = manifests if manifests is not None else StoreManifests(services.store)
        # An artifact seen published stays so until retention deletes it, so its id is trusted for
        # PUBLISHED_TRUST_SECONDS: a cache-hit submit is then one write transaction. Bounded by clearing,
        # wholesale, when full or that old (ids are cheap to re-read).
        self._published_ids: dict[str, int] = {}
        self._published_ids_until = time.monotonic() + PUBLISHED_TRUST_SECONDS
        #: Identical submits in flight together: one runs, the others wait and join at once.
        self.in_flight: InFlight[SubmitResult] = InFlight(self._join_together)

    # -- public -------------------------------------------------------------------------------------

    def submit(self, spec: CompileSpec | Prepared, *, principal: Principal | None = None,
               idempotency_key: str | None = None, queue_anyway: bool = False) -> SubmitResult:
        """Submit ``spec``, or a prepared one (:meth:`prepare`; a caller may keep one while it is
        :attr:`Prepared.reusable`), for ``principal`` (recorded as the build's submitter and team). A spec is
        prepared for the principal's team; a prepared one was checked for the team its preparer chose
        (:meth:`checked_for`), and the build is that team's (a roll-forward's: the source build's team).

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
        team = prepared.team if prepared.team is not None else principal.team if principal is not None else None
        team_urls = self.settings.team_webhooks.get(team, []) if team is not None else []
        context = SubmitContext(prepared.spec, prepared.pinned, keys, principal, idempotency_key, request_hash,
                                tuple(dict.fromkeys([*prepared.spec.callbacks, *team_urls])), team)
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
        except IdempotencyRace:
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
                result, outbox_ids, finalize = create_or_join(
                    self.services, context, imported, exclusive=seen is not None and not in_flight)
            except NeedsExclusive:
                imported = imported if imported is not None else self._admitted(context, queue_anyway)
                result, outbox_ids, finalize = create_or_join(self.services, context, imported, exclusive=True)
        except IdempotencyRace:  # an identical request with the same key committed first
            replay = self._replay(principal, idempotency_key or "", request_hash)
            if replay is None:
                raise RuntimeError("idempotency key vanished after a conflict") from None
            return replay
        if committed is not None:
            committed()
        self._after_commit(outbox_ids, finalize, result)
        if result.outcome == Outcome.NEW or finalize:
            # A new set's compiles may have moved since.
            return submit_results.reload(self.services.sessions, self._manifest_of, result)
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
        """The first answer to this principal's key (:func:`~compilesvc.builds.submit_results.replay`)."""
        return submit_results.replay(self.services.sessions, self._manifest_of, principal, idempotency_key,
                                     request_hash, self.settings.idempotency_key_seconds)

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
                return (import_artifact(self.services, ctx, manifest) if manifest is not None else None), None
            if found.state != ArtifactState.PUBLISHED:
                return None, found.state
            artifact_id = found.id
            if len(self._published_ids) >= _PUBLISHED_IDS_MAX:
                self._published_ids.clear()
            self._published_ids[key] = artifact_id
        record = ctx.build_record(artifact_id, key, ArtifactState.PUBLISHED, Outcome.HIT)
        if ctx.idempotency_key or ctx.callbacks:  # its key and its webhooks go in a transaction of its own
            with transaction(self.services.sessions) as session:
                build_id = require_build(add_build(session, self.settings, ctx, record))
        else:
            build_id = self.services.build_recorder.record(record)
        return SubmitResult(build_id=build_id, outcome=Outcome.HIT, state=record.row["state"], artifact_key=key,
                            artifact_state=ArtifactState.PUBLISHED, buckets=[],
                            manifest=self.manifests.published_manifest(key)), None

    def _after_commit(self, outbox_ids: list[int], finalize: bool, result: SubmitResult) -> None:
        self.services.relay.after_commit(outbox_ids, build_id=result.build_id)
        if finalize:
            with self.services.sessions() as session:
                artifact_id = session.scalars(select(Artifact.id).where(Artifact.key == result.artifact_key)).one()
            publish_if_complete(self.services.store, self.services.sessions, artifact_id,
                                signer=self.services.signer)

    def _manifest_of(self, key: str, state: str) -> ArtifactManifest | None:
        return self.manifests.published_manifest(key) if state == ArtifactState.PUBLISHED else None


__all__ = ["PUBLISHED_TRUST_SECONDS", "Prepared", "SubmitResult", "Submitter"]
