"""Preparing a submit: what it does before it reads the ledger. The spec's model is checked against the submitting
team's model sources (:mod:`compilesvc.pinning.model_sources`), pinned to immutable bytes (or an earlier build's pin
reused, for a roll-forward), and the artifact and bucket keys computed: a :class:`Prepared` spec, which
:class:`~compilesvc.builds.submit.Submitter` submits and the resolve endpoint and campaign plans only key."""

from __future__ import annotations

from dataclasses import dataclass, replace

from compilesvc.pinning.checkpoints import check_architecture
from compilesvc.pinning.model_sources import check_model_source
from compilesvc.pinning.pins import ModelRefError, PinnedModel
from compilesvc.services import Services
from compilesvc.spec.compile_spec import CompileSpec
from compilesvc.spec.keys import KeySet, compute_keys, digest, presharded
from compilesvc.spec.nxdi_config import NeuronConfigError


@dataclass(frozen=True)
class Prepared:
    """A spec with its model pinned and its keys computed (:meth:`Preparer.prepare`)."""

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


class Preparer:
    """Checks, pins and keys specs for one service (thread-safe: it keeps no state of its own)."""

    def __init__(self, services: Services):
        self.services = services
        self.settings = services.settings

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
