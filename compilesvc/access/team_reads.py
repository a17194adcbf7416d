"""The team boundary for reads (``COMPILESVC_TEAM_READS``): which builds, logs and artifacts a token may read.

Off by default: every token with the ``read`` scope reads everything. With the setting on, a non-admin
token is a bounded :class:`Reader` of its team, and every read goes through the helpers here (one per kind
of read: builds, artifacts, bucket compiles (statistics, running compiles), retention pins, campaigns, and
the build ids one build's page names), never through a condition copied into a view. The web side
(``web/readers.py``) only finds the request's reader and answers 404. The rules (docs/security.md, "Team
boundary for reads"):

- a build belongs to the team of the token that submitted it (``builds.team``); a build without a team
  (made before tokens had teams) is read by admins only;
- an artifact is the team's when any build of that team references it: deduplication lets two teams share
  one artifact, and each sees it through its own builds without learning of the other's;
- a ``fleet`` token is bounded too: an artifact key is derived from public inputs and can be guessed, so a
  lookup by key answers only artifacts its team built (or hit);
- admins read everything.

A view answers what a bounded reader may not read exactly as it answers what does not exist (404, an
empty or shorter list): an answer never confirms that another team's build or artifact exists.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, and_, exists, false, or_, select
from sqlalchemy.orm import Session

from compilesvc.access.tokens import Principal
from compilesvc.ledger.models import Artifact, ArtifactBucket, Build, BuildLabel
from compilesvc.ledger.retention import RetentionPin
from compilesvc.states import PinKind


@dataclass(frozen=True)
class Reader:
    """Whose data a request may read: everything (``bounded`` False), or the builds of ``team`` only."""

    bounded: bool = False
    team: str | None = None

    def may_read_team(self, team: str | None) -> bool:
        """Whether a build of ``team`` is readable (a build with no team is an admin's only)."""
        return not self.bounded or (team is not None and team == self.team)


EVERYTHING = Reader()


def reader_for(principal: Principal | None, team_reads: bool) -> Reader:
    """The reader a request's token is. A request without a token is bounded to no team: it only reaches
    a read under ``team_reads`` through a public view, which reads no team's data."""
    if not team_reads or (principal is not None and principal.is_admin):
        return EVERYTHING
    return Reader(bounded=True, team=principal.team if principal is not None else None)


def team_condition(reader: Reader, team_column: Any) -> ColumnElement[bool] | None:
    """The condition on a builds table (or an alias of it) that keeps ``reader``'s builds; None when every
    build is readable. A bounded reader without a team keeps none (``team = NULL`` would keep the
    builds without a team, which are the admins')."""
    if not reader.bounded:
        return None
    if reader.team is None:
        return false()
    return team_column == reader.team  # type: ignore[no-any-return]


def build_conditions(reader: Reader, build: Any = Build) -> list[ColumnElement[bool]]:
    """Conditions (none or one) keeping the readable rows of ``build`` (the Build entity or an alias)."""
    condition = team_condition(reader, build.team)
    return [] if condition is None else [condition]


def artifact_conditions(reader: Reader, artifact: Any = Artifact) -> list[ColumnElement[bool]]:
    """Conditions (none or one) keeping the readable rows of ``artifact``: those a build of the team
    references (a correlated EXISTS walking ``ix_builds_artifact_id_id``)."""
    condition = team_condition(reader, Build.team)
    if condition is None:
        return []
    return [exists(select(Build.id).where(Build.artifact_id == artifact.id, condition))]


def compile_conditions(reader: Reader, compile_id: Any) -> list[ColumnElement[bool]]:
    """Conditions (none or one) keeping the bucket compiles (by the ``compile_id`` column) that belong to an
    artifact the reader may read: a compile shared by two teams' artifacts counts for both."""
    condition = team_condition(reader, Build.team)
    if condition is None:
        return []
    return [exists(select(Build.id).join(ArtifactBucket, ArtifactBucket.artifact_id == Build.artifact_id)
                   .where(ArtifactBucket.bucket_compile_id == compile_id, condition))]


def pin_conditions(reader: Reader, pin: Any = RetentionPin) -> list[ColumnElement[bool]]:
    """Conditions (none or one) keeping the retention pins that name something of the reader's builds: an
    artifact key, a model name or a label one of its builds has. Another team's pin would tell its model
    names and labels."""
    condition = team_condition(reader, Build.team)
    if condition is None:
        return []
    labelled = exists(select(BuildLabel.build_id).where(BuildLabel.build_id == Build.id,
                                                        BuildLabel.name + ":" + BuildLabel.value == pin.value))
    return [exists(select(Build.id).where(condition, or_(
        and_(pin.kind == PinKind.ARTIFACT, Build.artifact_key == pin.value),
        and_(pin.kind == PinKind.MODEL, Build.model_name == pin.value),
        and_(pin.kind == PinKind.LABEL, labelled))))]


def may_read_campaigns(reader: Reader) -> bool:
    """Campaigns are an admin's roll-forward over every team's artifacts (their selection and progress
    count them all): a bounded reader sees none."""
    return not reader.bounded


def may_read_key(session: Session, reader: Reader, key: str) -> bool:
    """Whether the artifact with ``key`` is readable: one indexed query (the key, then its builds). A key the
    ledger does not know (a manifest only in the store) has no build, so a bounded reader cannot read it."""
    if not reader.bounded:
        return True
    return session.scalar(select(Build.id).join(Artifact, Artifact.id == Build.artifact_id)
                          .where(Artifact.key == key, *build_conditions(reader)).limit(1)) is not None


def readable_build_ids(session: Session, reader: Reader, build_ids: Iterable[int | None]) -> set[int]:
    """Those of ``build_ids`` the reader may read (for the build ids one build's page names: where its
    buckets came from, who compiled them again, whose key it is)."""
    wanted = {build_id for build_id in build_ids if build_id is not None}
    if not reader.bounded or not wanted:
        return wanted
    return set(session.scalars(select(Build.id).where(Build.id.in_(sorted(wanted)), *build_conditions(reader))))


class VisibleKeys:
    """Which (team, key) pairs were found readable, remembered for ``ttl`` seconds: the fleet's lookup by
    key then costs a dict lookup, not a ledger query. Only "readable" is remembered: a team gains an
    artifact at its first build of it (a hit included) and must see it at once, while losing one (retention
    never deletes builds) does not happen. Bounded like an LRU."""

    def __init__(self, sessions: Callable[[], AbstractContextManager[Session]], *, ttl: float = 300.0,
                 maxsize: int = 65536):
        self._sessions = sessions
        self._ttl = ttl
        self._maxsize = maxsize
        self._seen: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._lock = threading.Lock()

    def readable(self, reader: Reader, key: str) -> bool:
        if not reader.bounded:
            return True
        if reader.team is None:
            return False
        pair = (reader.team, key)
        now = time.monotonic()
        with self._lock:
            until = self._seen.get(pair)
            if until is not None and until > now:
                self._seen.move_to_end(pair)
                return True
        with self._sessions() as session:
            found = may_read_key(session, reader, key)
        if found:
            with self._lock:
                self._seen[pair] = now + self._ttl
                self._seen.move_to_end(pair)
                while len(self._seen) > self._maxsize:
                    self._seen.popitem(last=False)
        return found

