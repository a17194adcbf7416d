"""Which S3 models a team may name (``COMPILESVC_MODEL_S3_PREFIXES``): the check that keeps the service's S3 role
from reading one team's models for another (a confused deputy: the service reads, compiles and, with NxDI
pre-sharding, copies the weights into the asker's artifact).

:func:`check_model_source` runs before a spec's model is pinned, on the URI's text alone: no S3 request is made
for a refused URI, so the answer is the same whether the object exists or not. A team may name the prefixes
listed for it and those listed for ``"*"``; nothing else (secure by default: with the setting unset, no team
may name an s3:// model). Whose team applies is the caller's (docs/security.md, "Model sources"):

- a submit or a resolve: the token's team, admins included (an admin needing another team's model asks with a
  token of that team); a request without a token (authentication off, the embedded service): ``"*"`` only;
- a roll-forward campaign or a standing policy: the team of the build whose spec is resubmitted.

``blob:`` models are uploads named by their content, and ``file://`` models are off unless an operator allows
them (``COMPILESVC_ALLOW_FILE_MODELS``): neither is this module's.
"""

from __future__ import annotations

from compilesvc.config.model_prefixes import EVERY_TEAM, has_dot_segment
from compilesvc.config.settings import Settings
from compilesvc.pinning.pins import ModelRefError
from compilesvc.spec.compile_spec import ModelRef

SETTING = "COMPILESVC_MODEL_S3_PREFIXES"


class ModelSourceRefused(ModelRefError):
    """The team may not name this S3 model (a 422 on ``model.uri``)."""


def may_read(settings: Settings, team: str | None, uri: str) -> bool:
    """Whether ``team`` (None: no team) may name the S3 model ``uri`` (``s3://bucket/key`` or a prefix)."""
    bucket, _, key = uri.removeprefix("s3://").partition("/")  # as pinning splits it (s3_models.parse_s3_uri)
    if not uri.startswith("s3://") or has_dot_segment(key):
        return False
    allowed = settings.model_prefixes
    teams = [EVERY_TEAM] if team is None else [EVERY_TEAM, team]
    return any(prefix.covers(bucket, key) for name in teams for prefix in allowed.get(name, ()))


def check_model_source(settings: Settings, team: str | None, model: ModelRef) -> None:
    """Refuse (:class:`ModelSourceRefused`) an ``s3://`` model ``team`` may not name; other schemes pass."""
    if not model.uri.startswith("s3://") or may_read(settings, team, model.uri):
        return
    who = f"team {team!r}" if team is not None else "a request without a team (no token)"
    if has_dot_segment(model.uri.removeprefix("s3://").partition("/")[2]):
        raise ModelSourceRefused(f"{who} may not read {model.uri}: a key with a '.' or '..' segment names no "
                                 "prefix for certain (name the object by its plain key)")
    raise ModelSourceRefused(f"{who} may not read {model.uri}: an operator lists the prefixes each team may name "
                             f"in {SETTING}")
