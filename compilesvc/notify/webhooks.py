"""Webhooks: a signed POST to a build's callback URLs when it reaches a terminal state, and to the URLs
subscribed service-wide to an event (``artifact.published``, ``build.failed``, ``campaign.started``,
``campaign.finished``: a deployment system rolling a fleet once its artifacts exist).

A build names callback URLs in its spec (``callbacks``), and an operator may name more per team
(``COMPILESVC_TEAM_WEBHOOKS``); each becomes a ``webhooks`` row when the build is recorded. When the build
reaches ``succeeded``, ``failed`` or ``cancelled`` (a hit is born succeeded), :func:`enqueue_terminal`
writes one ``webhook_deliveries`` row per URL *in the transaction that moves the build*, so a delivery is
never lost to a crash and never made for a move that rolled back (the outbox pattern, as for dispatch).
Subscriptions (``event_subscriptions``) get theirs the same way from :func:`enqueue_event`, in the
transaction that publishes the artifact, fails the build, starts (by an operator or a standing policy:
the document names it) or finishes the campaign. Both are subscribers of
:mod:`compilesvc.ledger.events` (:data:`BUILD_CALLBACKS`, :data:`SUBSCRIPTIONS`), installed by
:func:`compilesvc.services.install_subscribers`. The relay sends due deliveries (:func:`deliver_due`), each
try recorded in ``webhook_attempts``, retrying a failure (no answer, a non-2xx) with backoff until
``webhook_max_attempts``.

Every delivery is the same bytes on every try, signed per Standard Webhooks (``webhook-id``, the delivery, for
the receiver's dedupe; ``webhook-timestamp``; ``webhook-signature``), and for this release also with the deprecated
``Compilesvc-Webhook-*`` headers (:mod:`compilesvc.notify.signatures`; docs/api.md shows how to check them). URLs
are http(s) and must not resolve to an address of a blocked kind (:mod:`compilesvc.notify.destinations`: loopback,
private, link-local, CGNAT, cloud metadata, special-purpose, IPv4 embedded in IPv6 …), unless an operator allows
those networks (``COMPILESVC_WEBHOOK_ALLOW_NETWORKS``); the check is made at submit and again before every try, and
a try connects to the address it checked (resolved once), following no redirect.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import random
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any, cast

from sqlalchemy import Table, insert, literal, select, update
from sqlalchemy.orm import Session, sessionmaker

from compilesvc.ledger.campaigns import Campaign, RollforwardPolicy
from compilesvc.ledger.engine import transaction
from compilesvc.ledger.events import Subscriber, Transition
from compilesvc.ledger.models import Artifact, Build, UTCDateTime, utcnow
from compilesvc.ledger.webhooks import EventSubscription, Webhook, WebhookAttempt, WebhookDelivery
from compilesvc.lifecycle import campaigns
from compilesvc.notify import signatures
from compilesvc.notify.destinations import post, resolve_checked
from compilesvc.notify.signatures import ID_HEADER as ID_HEADER
from compilesvc.notify.signatures import SIGNATURE_HEADER as SIGNATURE_HEADER
from compilesvc.notify.signatures import TIMESTAMP_HEADER as TIMESTAMP_HEADER
from compilesvc.notify.signatures import sign as sign
from compilesvc.notify.signatures import verify as verify
from compilesvc.refusals import SubmitRefused
from compilesvc.states import ArtifactState, BuildState, CampaignState, ServiceEvent

log = logging.getLogger(__name__)

TERMINAL = frozenset({BuildState.SUCCEEDED, BuildState.FAILED, BuildState.CANCELLED})
SEND_TIMEOUT_SECONDS = 10.0
#: A delivery being sent is not picked by another relay for this long.
CLAIM_SECONDS = 60.0
MAX_URL = 2048
_INSERT_DELIVERIES = insert(cast(Table, WebhookDelivery.__table__))


class CallbackRefused(SubmitRefused):
    """A callback URL the service will not call (422, naming the field)."""

    status = 422
    code = "callback-invalid"

    def __init__(self, index: int, reason: str):
        self.field = f"callbacks[{index}]"
        self.reason = reason
        super().__init__(f"{self.field}: {reason}")


def check_url(url: str, allowed: Iterable[ipaddress.IPv4Network | ipaddress.IPv6Network] = ()) -> None:
    """Refuse (ValueError) a URL compilesvc must not call (:func:`compilesvc.notify.destinations.resolve_checked`)."""
    resolve_checked(url, allowed)


def check_callbacks(urls: Iterable[str], allowed: Iterable[ipaddress.IPv4Network | ipaddress.IPv6Network]) -> None:
    allowed = tuple(allowed)
    for index, url in enumerate(urls):
        try:
            check_url(url, allowed)
        except ValueError as exc:
            raise CallbackRefused(index, str(exc)) from None


def subscription_rows(build_id: int, urls: Iterable[str]) -> list[dict[str, Any]]:
    now = utcnow()
    return [{"build_id": build_id, "url": url, "created_at": now} for url in dict.fromkeys(urls)]


def enqueue_terminal(session: Session, build_id: int, state: str) -> None:
    """In the transaction moving build ``build_id`` to ``state``: a delivery per subscribed URL if the state
    is terminal (one INSERT … SELECT; nothing when the build has no webhooks)."""
    if state not in TERMINAL:
        return
    now = utcnow()
    session.execute(_INSERT_DELIVERIES.from_select(
        ["webhook_id", "build_id", "event", "state", "attempts", "next_attempt_at", "created_at"],
        select(Webhook.id, Webhook.build_id, literal(f"build.{state}"), literal("pending"), literal(0),
               literal(now, UTCDateTime()), literal(now, UTCDateTime())).where(Webhook.build_id == build_id),
    ))


def _wants_build_callbacks(transition: Transition) -> bool:
    if transition.from_state is None:  # born: its URLs to record, notified at once if it is born ended
        return bool(transition.callbacks)
    return transition.to_state in TERMINAL


def _on_build(session: Session, transition: Transition) -> None:
    if transition.callbacks:
        session.execute(insert(Webhook), subscription_rows(transition.entity_id, transition.callbacks))
    enqueue_terminal(session, transition.entity_id, transition.to_state)


#: A build's own callbacks: recorded when it is created, notified when it ends.
BUILD_CALLBACKS = Subscriber("build callbacks", frozenset({"build"}), _wants_build_callbacks, _on_build)

#: The transitions that are service-wide events.
SERVICE_EVENTS: dict[tuple[str, str], ServiceEvent] = {
    ("artifact", ArtifactState.PUBLISHED): ServiceEvent.ARTIFACT_PUBLISHED,
    ("build", BuildState.FAILED): ServiceEvent.BUILD_FAILED,
    ("campaign", CampaignState.FINISHED): ServiceEvent.CAMPAIGN_FINISHED,
}


#: Births that are service-wide events (a campaign reopened by a retry is running again, not started).
SERVICE_BIRTHS: dict[tuple[str, str], ServiceEvent] = {
    ("campaign", CampaignState.RUNNING): ServiceEvent.CAMPAIGN_STARTED,
}


def _service_event(transition: Transition) -> ServiceEvent | None:
    if transition.from_state is None and (transition.entity, transition.to_state) in SERVICE_BIRTHS:
        return SERVICE_BIRTHS[transition.entity, transition.to_state]
    return SERVICE_EVENTS.get((transition.entity, transition.to_state))


def _wants_service_event(transition: Transition) -> bool:
    return _service_event(transition) is not None


def _on_service_event(session: Session, transition: Transition) -> None:
    event = _service_event(transition)
    assert event is not None
    enqueue_event(session, event, transition.entity_id)


#: The URLs subscribed service-wide to what just happened.
SUBSCRIPTIONS = Subscriber("event subscriptions",
                           frozenset(entity for entity, _ in (*SERVICE_EVENTS, *SERVICE_BIRTHS)),
                           _wants_service_event, _on_service_event)


def enqueue_event(session: Session, event: ServiceEvent, subject_id: int) -> None:
    """In the transaction that made ``event`` (about artifact, build or campaign ``subject_id``): a delivery
    per URL subscribed to it (one INSERT … SELECT; nothing when nobody is)."""
    now = utcnow()
    session.execute(_INSERT_DELIVERIES.from_select(
        ["subscription_id", "subject_id", "event", "state", "attempts", "next_attempt_at", "created_at"],
        select(EventSubscription.id, literal(subject_id), literal(str(event)), literal("pending"), literal(0),
               literal(now, UTCDateTime()), literal(now, UTCDateTime())).where(EventSubscription.event == str(event)),
    ))


def payload(session: Session, delivery: WebhookDelivery, public_url: str) -> bytes:
    """The event, as JSON bytes: what it is about (a build, an artifact, a campaign) as of the event."""
    base = public_url.rstrip("/")
    document: dict[str, Any] = {"id": f"whd_{delivery.id}", "type": delivery.event,
                                "created_at": delivery.created_at.isoformat()}
    subject = delivery.build_id if delivery.build_id is not None else delivery.subject_id
    assert subject is not None
    if delivery.event.startswith("build."):
        document["build"] = _build_document(session.get_one(Build, subject), delivery.event, base)
    elif delivery.event == ServiceEvent.ARTIFACT_PUBLISHED:
        document["artifact"] = _artifact_document(session, session.get_one(Artifact, subject), base)
    elif delivery.event in (ServiceEvent.CAMPAIGN_FINISHED, ServiceEvent.CAMPAIGN_STARTED):
        document["campaign"] = _campaign_document(session, subject, base)
    return json.dumps(document, separators=(",", ":"), sort_keys=True, default=str).encode()


def _build_document(build: Build, event: str, base: str) -> dict[str, Any]:
    state = event.removeprefix("build.")
    return {
        "id": build.id, "state": state, "outcome": build.outcome, "artifact_key": build.artifact_key,
        "target": build.target, "sdk": build.sdk, "model_name": build.model_name,
        "submitted_by": build.submitted_by, "team": build.team, "labels": build.labels,
        "build_url": f"{base}/builds/{build.id}", "status_url": f"{base}/v1/builds/{build.id}",
        "artifact_url": f"{base}/v1/artifacts/{build.artifact_key}" if state == BuildState.SUCCEEDED else None,
    }


def _artifact_document(session: Session, artifact: Artifact, base: str) -> dict[str, Any]:
    """The artifact, and the model name and labels of the build that asked for it first."""
    first = session.scalars(select(Build).where(Build.artifact_id == artifact.id).order_by(Build.id).limit(1)).first()
    return {"key": artifact.key, "target": artifact.target, "sdk": artifact.sdk, "backend": artifact.backend,
            "model_sha256": artifact.model_sha256, "size_bytes": artifact.size_bytes,
            "published_at": artifact.published_at.isoformat() if artifact.published_at else None,
            "model_name": first.model_name if first else None, "labels": first.labels if first else {},
            "artifact_url": f"{base}/v1/artifacts/{artifact.key}"}


def _campaign_document(session: Session, campaign_id: int, base: str) -> dict[str, Any]:
    campaign = session.get_one(Campaign, campaign_id)
    progress = campaigns.progress(session, campaign)
    counts = {name: getattr(progress, name) for name in
              ("total", "built", "hit", "failed", "cancelled", "refused", "building")}
    return {"id": campaign.id, "from_sdk": campaign.from_sdk, "to_sdk": campaign.to_sdk, "state": campaign.state,
            "progress": counts, "new_artifact_keys": [i["artifact_key"] for i in progress.items
                                                      if i["state"] == BuildState.SUCCEEDED],
            "policy": _policy_name(session, campaign.policy_id), "url": f"{base}/v1/campaigns/{campaign.id}"}


def _policy_name(session: Session, policy_id: int | None) -> str | None:
    """The standing roll-forward policy that started a campaign (none: an operator did)."""
    if policy_id is None:
        return None
    return session.scalar(select(RollforwardPolicy.name).where(RollforwardPolicy.id == policy_id))


def backoff(attempt: int, base: float, cap: float) -> float:
    """Seconds before try ``attempt + 1``: base * 2**(attempt-1), jittered by ±20 %, capped."""
    return float(min(cap, base * 2 ** max(0, attempt - 1)) * random.uniform(0.8, 1.2))


class Sender:
    """Sends due deliveries (the relay's); thread-compatible, one per relay process."""

    def __init__(self, sessions: sessionmaker[Session], *, secret: bytes, public_url: str,
                 allowed: Iterable[ipaddress.IPv4Network | ipaddress.IPv6Network] = (), max_attempts: int = 8,
                 backoff_seconds: float = 5.0, backoff_max_seconds: float = 600.0):
        self.sessions = sessions
        self.secret = secret
        self.public_url = public_url
        self.allowed = tuple(allowed)
        self.max_attempts = max_attempts
        self.backoff_seconds = backoff_seconds
        self.backoff_max_seconds = backoff_max_seconds

    def deliver_due(self, limit: int = 20) -> int:
        """Send up to ``limit`` due deliveries; how many were tried."""
        tried = 0
        for delivery_id in self._claim(limit):
            self._send(delivery_id)
            tried += 1
        return tried

    def _claim(self, limit: int) -> list[int]:
        """Take due deliveries for ``CLAIM_SECONDS`` (another relay skips them meanwhile); no lock is held
        while a receiver answers."""
        now = utcnow()
        with transaction(self.sessions) as session:
            due = list(session.execute(
                select(WebhookDelivery.id, WebhookDelivery.next_attempt_at)
                .where(WebhookDelivery.state == "pending", WebhookDelivery.next_attempt_at <= now)
                .order_by(WebhookDelivery.next_attempt_at).limit(limit)
            ))
            claimed = []
            for delivery_id, due_at in due:
                taken = session.execute(
                    update(WebhookDelivery)
                    .where(WebhookDelivery.id == delivery_id, WebhookDelivery.next_attempt_at == due_at)
                    .values(next_attempt_at=now + timedelta(seconds=CLAIM_SECONDS))
                )
                if getattr(taken, "rowcount", 0) != 0:
                    claimed.append(delivery_id)
            return claimed

    def _send(self, delivery_id: int) -> None:
        with transaction(self.sessions) as session:
            delivery = session.get_one(WebhookDelivery, delivery_id)
            url = (session.get_one(Webhook, delivery.webhook_id).url if delivery.webhook_id is not None
                   else session.get_one(EventSubscription, delivery.subscription_id).url)
            if delivery.payload is None:  # made once: every try sends the same bytes
                delivery.payload = payload(session, delivery, self.public_url).decode()
            body = delivery.payload.encode()
            attempt = delivery.attempts + 1
        started = time.monotonic()
        status, error = self._post(url, delivery_id, body)
        ok = status is not None and 200 <= status < 300
        with transaction(self.sessions) as session:
            delivery = session.get_one(WebhookDelivery, delivery_id)
            session.add(WebhookAttempt(delivery_id=delivery_id, attempt=attempt, at=utcnow(), status_code=status,
                                       error=error, duration_ms=round((time.monotonic() - started) * 1000, 1)))
            delivery.attempts = attempt
            delivery.last_status = status
            delivery.last_error = error
            if ok:
                delivery.state, delivery.delivered_at = "delivered", utcnow()
            elif attempt >= self.max_attempts:
                delivery.state = "failed"
            else:
                delay = backoff(attempt, self.backoff_seconds, self.backoff_max_seconds)
                delivery.next_attempt_at = utcnow() + timedelta(seconds=delay)
        log.info("webhook delivery", extra={"delivery_id": delivery_id, "attempt": attempt, "status": status,
                                            "error": error, "delivered": ok})

    def _post(self, url: str, delivery_id: int, body: bytes) -> tuple[int | None, str | None]:
        try:
            # Again (what a name resolves to may have changed since the submit), and once: the try connects to
            # the address checked here, never to what a second lookup would answer.
            destination = resolve_checked(url, self.allowed)
        except ValueError as exc:
            return None, f"refused: {exc}"
        timestamp = int(time.time())
        try:  # a whsec_ secret that is not base64 is a ValueError: a failed try, named
            sent = {"Content-Type": "application/json", "User-Agent": "compilesvc-webhooks/1",
                    **signatures.headers(self.secret, f"whd_{delivery_id}", timestamp, body)}
            status = post(destination, body, sent, SEND_TIMEOUT_SECONDS)
        except (OSError, ValueError) as exc:
            return None, f"{type(exc).__name__}: {exc}"[:500]
        # A redirect could lead anywhere the check would refuse: a 3xx is a failed try, as any non-2xx.
        return status, None if 200 <= status < 300 else f"HTTP {status}"
