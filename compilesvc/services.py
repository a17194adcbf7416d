"""The service container and composition root: one place that builds the engine, sessions, store, model
resolver and producer from :class:`~compilesvc.config.settings.Settings`, and that installs what reacts to a state
change (:func:`install_subscribers`). The API, the relay/reaper, the workers and every command that writes
to the ledger each hold one."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import cached_property

from celery import Celery
from cryptography.hazmat.primitives.asymmetric import ec
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from compilesvc.config.settings import Settings
from compilesvc.dispatch.outbox import OutboxRelay
from compilesvc.dispatch.routing import make_producer
from compilesvc.hostinfo import host_isa
from compilesvc.ledger import events
from compilesvc.ledger.build_records import BuildRecorder
from compilesvc.ledger.engine import make_engine, make_sessionmaker
from compilesvc.lifecycle import campaigns
from compilesvc.notify import webhooks
from compilesvc.pinning.identity import ModelResolver
from compilesvc.signing.artifacts import ArtifactSigner
from compilesvc.signing.keys import GENERATED_KEY_NAME, KeyFileError, SigningKey, TrustedKeys
from compilesvc.store import ArtifactStore, open_store

#: What a state change sets off, in this order (:mod:`compilesvc.ledger.events` calls them in it): a build's own
#: callbacks; then its campaign, finished or reopened (which records the campaign's move, and so
#: notifies ``campaign.finished`` before the next one runs); then the service-wide subscriptions of what
#: just happened (``artifact.published``, ``build.failed``, ``campaign.started``, ``campaign.finished``).
SUBSCRIBERS: tuple[events.Subscriber, ...] = (webhooks.BUILD_CALLBACKS, campaigns.BUILDS, webhooks.SUBSCRIPTIONS)


def install_subscribers() -> None:
    """Install :data:`SUBSCRIBERS` in this process (again is harmless). :class:`Services` does it, so every
    process holding one writes events with their consequences; one that does not gets
    :class:`~compilesvc.ledger.events.SubscribersNotInstalled` at its first event."""
    events.install(SUBSCRIBERS)


def publishing_key(settings: Settings) -> SigningKey | None:
    """The key a process publishing with ``settings`` signs with; None with ``publish_unsigned``."""
    if settings.publish_unsigned:
        return None
    if settings.signing_key_file is not None:
        return SigningKey.load(settings.signing_key_file)
    return SigningKey.load_or_generate(settings.data_dir / GENERATED_KEY_NAME)


@dataclass
class Services:
    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    store: ArtifactStore
    default_isa: str = field(default_factory=host_isa)
    #: The Celery app outbox rows are sent through; None builds a send-only one on first use. A worker passes
    #: its own app, so its requeues go out on the connection pool it already holds.
    celery_app: Celery | None = None

    def __post_init__(self) -> None:
        install_subscribers()

    @classmethod
    def from_settings(cls, settings: Settings | None = None, *, pre_ping: bool = False,
                      celery_app: Celery | None = None) -> Services:
        """``pre_ping`` checks each pooled connection before use: one round trip per checkout, which the
        API's hot path does not pay, but which lets the relay and the workers (a few transactions a second)
        come through a database restart without a failed statement."""
        settings = settings or Settings()
        engine = make_engine(settings.resolved_database_url, pool_pre_ping=pre_ping)
        return cls(settings=settings, engine=engine, sessions=make_sessionmaker(engine),
                   store=open_store(settings), celery_app=celery_app)

    @cached_property
    def signer(self) -> ArtifactSigner | None:
        """The key that signs what this process publishes: ``signing_key_file``, else one generated in
        data_dir like the secret key (a per-host key that fleets do not trust until its public key is
        given to them, so a forgotten setting fails closed); None only with ``publish_unsigned``."""
        key = publishing_key(self.settings)
        return None if key is None else ArtifactSigner(key, builder_id=self.settings.public_url)

    def trusted_keys(self) -> TrustedKeys:
        """The keys this service accepts as its own: ``COMPILESVC_TRUSTED_KEYS`` (e.g. the previous key of
        a rotation) and the key it signs with. An unreadable trusted-keys setting leaves the signing key."""
        keys: dict[str, ec.EllipticCurvePublicKey] = {}
        with contextlib.suppress(KeyFileError):
            keys.update(TrustedKeys.from_environment().keys)
        if self.signer is not None:
            keys[self.signer.key.key_id] = self.signer.key.public_key
        return TrustedKeys(keys)

    @cached_property
    def build_recorder(self) -> BuildRecorder:
        return BuildRecorder(self.engine)

    @cached_property
    def resolver(self) -> ModelResolver:
        return ModelResolver(self.settings, self.store, self.sessions)

    @cached_property
    def producer(self) -> Celery:
        return self.celery_app or make_producer(self.settings)

    @cached_property
    def relay(self) -> OutboxRelay:
        return OutboxRelay(self.sessions, self.producer)

    def close(self) -> None:
        if "build_recorder" in self.__dict__:  # made on first use (cached_property)
            self.build_recorder.close()
        self.engine.dispose()
