"""Ledger tables of notifications: a build's webhook URLs, service-wide event subscriptions, and the
deliveries of both with every try (:mod:`compilesvc.notify.webhooks` owns the behaviour).

Registered on the same metadata as :mod:`compilesvc.ledger.models`, which imports this module last.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint, text
from sqlalchemy.orm import Mapped, mapped_column

from compilesvc.ledger.models import Base, BigId, check_constraint, utcnow
from compilesvc.states import ServiceEvent


class Webhook(Base):
    """A URL to notify when a build ends (the spec's ``callbacks`` and its team's configured URLs)."""

    __tablename__ = "webhooks"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    build_id: Mapped[int] = mapped_column(ForeignKey("builds.id", ondelete="CASCADE"))
    url: Mapped[str] = mapped_column(String(2048))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    __table_args__ = (Index("ix_webhooks_build_id", "build_id"),)


class EventSubscription(Base):
    """A URL notified of one kind of event service-wide (a deployment system: ``artifact.published``,
    ``build.failed``, ``campaign.started``, ``campaign.finished``)."""

    __tablename__ = "event_subscriptions"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    url: Mapped[str] = mapped_column(String(2048))
    event: Mapped[str] = mapped_column(String(32))
    created_by: Mapped[str | None] = mapped_column(String(255))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    __table_args__ = (UniqueConstraint("url", "event"), Index("ix_event_subscriptions_event", "event"),
                      check_constraint("event", ServiceEvent, "event"))


class WebhookDelivery(Base):
    """One event to deliver to one URL (written in the transaction that made the event: ended the build,
    published the artifact, finished the campaign); the relay sends it until it is delivered or has failed
    ``webhook_max_attempts`` times."""

    __tablename__ = "webhook_deliveries"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    webhook_id: Mapped[int | None] = mapped_column(ForeignKey("webhooks.id", ondelete="CASCADE"),
                                                   doc="A build's own webhook (else: a subscription's delivery).")
    build_id: Mapped[int | None] = mapped_column(ForeignKey("builds.id", ondelete="CASCADE"))
    subscription_id: Mapped[int | None] = mapped_column(ForeignKey("event_subscriptions.id", ondelete="CASCADE"))
    subject_id: Mapped[int | None] = mapped_column(
        BigInteger, doc="A subscription's event: the artifact, build or campaign it is about (by the event's type).")
    event: Mapped[str] = mapped_column(String(32), doc="build.* | artifact.published | campaign.*")
    state: Mapped[str] = mapped_column(String(16), doc="pending | delivered | failed")
    payload: Mapped[str | None] = mapped_column(Text, doc="The body, made at the first try and sent on every try.")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_status: Mapped[int | None] = mapped_column(Integer)
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    delivered_at: Mapped[datetime | None]

    __table_args__ = (
        Index("ix_webhook_deliveries_build_id", "build_id"),
        Index("ix_webhook_deliveries_due", "next_attempt_at", postgresql_where=text("state = 'pending'"),
              sqlite_where=text("state = 'pending'")),
    )


class WebhookAttempt(Base):
    """One try of a delivery: when, the receiver's status (None: no answer) or the error, how long."""

    __tablename__ = "webhook_attempts"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    delivery_id: Mapped[int] = mapped_column(ForeignKey("webhook_deliveries.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    at: Mapped[datetime] = mapped_column(default=utcnow)
    status_code: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    duration_ms: Mapped[float] = mapped_column(Float)

    __table_args__ = (Index("ix_webhook_attempts_delivery_id", "delivery_id"),)
