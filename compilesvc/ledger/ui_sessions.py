"""Ledger table of the UI's sessions: one row per login, so logging out or revoking the token ends it on
the server, whatever copies of the cookie exist (:mod:`compilesvc.access.ui_sessions` owns the behaviour).

Registered on the same metadata as :mod:`compilesvc.ledger.models`, which imports this module last.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ForeignKey, Index, String
from sqlalchemy.orm import Mapped, mapped_column

from compilesvc.ledger.models import Base, BigId, utcnow


class UiSession(Base):
    """A browser's login: the cookie holds a random secret, the ledger only its sha256 (like tokens)."""

    __tablename__ = "ui_sessions"

    id_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    token_id: Mapped[int] = mapped_column(BigId, ForeignKey("api_tokens.id", ondelete="CASCADE"))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime]
    ended_at: Mapped[datetime | None] = mapped_column(doc="Logged out, or its token revoked.")

    __table_args__ = (Index("ix_ui_sessions_token_id", "token_id"),
                      Index("ix_ui_sessions_expires_at", "expires_at"))
