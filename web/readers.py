"""The request's side of the team boundary for reads (:mod:`compilesvc.access.team_reads`): who the request reads
as, the one 404 for a build or an artifact it may not read, and the build ids a page may name.

The views call these; the conditions themselves are the core's. Whatever a reader may not read is answered
as if it did not exist, with the same problem and words.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from flask import current_app, g
from sqlalchemy import select
from sqlalchemy.orm import Session

from compilesvc.access import team_reads
from compilesvc.access.team_reads import Reader, VisibleKeys
from compilesvc.builds.provenance import Origin
from compilesvc.ledger.models import Build
from web.auth import current_principal
from web.context import web
from web.contract.problems import Problem

_VISIBLE_KEYS = "compilesvc.visible_keys"


def reader() -> Reader:
    """Whose builds this request may read (found once per request)."""
    if not web().settings.team_reads:
        return team_reads.EVERYTHING  # the default: no token is looked at again
    if "reader" not in g:
        g.reader = team_reads.reader_for(current_principal(), True)
    found: Reader = g.reader
    return found


def no_build(build_id: int) -> Problem:
    return Problem("build-not-found", f"no build {build_id}")


def no_artifact(key: str) -> Problem:
    return Problem("artifact-not-found", f"no artifact has key {key}")


def require_build(session: Session, build_id: int) -> Build:
    """Build ``build_id`` if it exists and the request may read it; the same 404 otherwise."""
    build = session.get(Build, build_id)
    if build is None or not reader().may_read_team(build.team):
        raise no_build(build_id)
    return build


def build_state(session: Session, who: Reader, build_id: int) -> str | None:
    """The state of build ``build_id`` as ``who`` sees it (None: none, or not theirs). Takes the reader, not
    the request: a log stream asks again after its request context is gone."""
    return session.scalar(select(Build.state).where(Build.id == build_id, *team_reads.build_conditions(who)))


def visible_keys() -> VisibleKeys:
    """This process's memory of readable (team, key) pairs: the fleet's lookup by key stays a dict lookup."""
    found = current_app.extensions.get(_VISIBLE_KEYS)
    if found is None:
        found = current_app.extensions.setdefault(_VISIBLE_KEYS, VisibleKeys(web().services.sessions))
    return found  # type: ignore[no-any-return]


def require_key(key: str) -> None:
    """404 (as for a key nobody built) unless the request may read the artifact ``key``. Free when the
    boundary is off or the token is an admin's."""
    who = reader()
    if who.bounded and not visible_keys().readable(who, key):
        raise no_artifact(key)


def readable_ids(session: Session, ids: Iterable[int | None]) -> set[int]:
    return team_reads.readable_build_ids(session, reader(), ids)


def redact_origins(session: Session, origins: dict[int, Origin]) -> dict[int, Origin]:
    """The buckets' origins naming only builds the request may read: another team's build that compiled a
    shared bucket becomes "another build" (``None``), so the page says how, not whose."""
    if not reader().bounded:
        return origins
    named = [o.from_build for o in origins.values()] + [o.again_by for o in origins.values()]
    keep = readable_ids(session, named)
    return {cid: dataclasses.replace(o, from_build=o.from_build if o.from_build in keep else None,
                                     again_by=o.again_by if o.again_by in keep else None)
            for cid, o in origins.items()}
