"""Query strings and headers: the models each endpoint declares for them, and reading a request into those
models (400 ``invalid-request`` naming each bad parameter).

A view declares its models once, in :func:`web.contract.openapi.operation`; that declaration both reads the request
(:func:`read_query`, :func:`read_headers`) and documents the parameters in ``/openapi.json``, so the two
cannot differ. The readers are exact, because the document has to be: an integer is decimal digits (not
``1.0``, ``+5`` or ``1_000``, which pydantic's lax mode would take), a boolean is ``true`` or ``false``, a
scalar parameter given twice is refused rather than silently reduced to one, and no text may hold a NUL
(which Postgres refuses deep inside a query).
"""

from __future__ import annotations

import functools
import re
import typing
from typing import Annotated, Any, TypeVar

from flask import request
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from compilesvc.insights.history import HistoryFilter
from compilesvc.spec.parsing import validation_errors
from web.contract.problems import Problem

M = TypeVar("M", bound=BaseModel)

MAX_ID = 2**63 - 1
MAX_LOG_LIMIT = 5000
DEFAULT_LOG_LIMIT = 1000
#: What every text parameter documents (and the readers enforce): no NUL characters.
NO_NUL_PATTERN = "^[^\\u0000]*$"
_DECIMAL = re.compile(r"-?[0-9]{1,20}")


def _decimal(value: Any) -> Any:
    if isinstance(value, str) and not _DECIMAL.fullmatch(value):
        raise ValueError("expected an integer (decimal digits)")
    return value


def _boolean(value: Any) -> Any:
    if isinstance(value, str):
        if value not in ("true", "false"):
            raise ValueError("expected true or false")
        return value == "true"
    return value


#: An integer query parameter or header: decimal digits only.
QueryInt = Annotated[int, BeforeValidator(_decimal)]
#: A boolean query parameter: ``true`` or ``false``.
QueryBool = Annotated[bool, BeforeValidator(_boolean)]
#: A header of visible ASCII text (werkzeug decodes headers as Latin-1, so anything else arrives mangled).
HeaderText = Annotated[str, Field(max_length=255, pattern=r"^[\x20-\x7E]*$")]
Sha256Hex = Annotated[str, Field(pattern="^[0-9a-fA-F]{64}$")]


class Query(BaseModel):
    """Base of query models: parameters the endpoint does not declare are ignored (cache busters)."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class Headers(BaseModel):
    """Base of header models: fields are named by their header (``alias``); other headers are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)


# -- the endpoints' parameters -------------------------------------------------------------------------------

class SubmitQuery(Query):
    queue_anyway: QueryBool = Field(default=False, description="Queue even when no live worker serves the "
                                    "target/SDK (otherwise 503 no-capable-worker).")


class SubmitHeaders(Headers):
    idempotency_key: HeaderText | None = Field(
        default=None, alias="Idempotency-Key",
        description="Your token's key for this request: the same key with the same body within a day (the "
                    "`idempotency_key_seconds` setting) replays the first answer (status and build, marked "
                    "`Idempotent-Replayed: true`); a different body with the same key is refused (422).")


class BuildListQuery(HistoryFilter):
    """GET /v1/builds: the history filters (:class:`compilesvc.insights.history.HistoryFilter`, where they are
    defined), a page size and the cursor. Like the filters, an empty ``cursor`` means none."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    limit: QueryInt = Field(default=50, ge=1, le=200)
    cursor: str | None = Field(default=None, max_length=64, description="`next_cursor` of the previous page.")


#: The filter fields, in the order the UI shows them.
FILTERS = tuple(HistoryFilter.model_fields)


class LogsQuery(Query):
    after: QueryInt = Field(default=0, ge=0, le=MAX_ID,
                            description="Return lines with id > after (the previous `next_after`).")
    limit: QueryInt = Field(default=DEFAULT_LOG_LIMIT, ge=1, le=MAX_LOG_LIMIT, description="At most this many lines.")


class StreamQuery(Query):
    after: QueryInt = Field(default=0, ge=0, le=MAX_ID,
                            description="Resume after this line id (when there is no Last-Event-ID).")


class StreamHeaders(Headers):
    last_event_id: Annotated[int, Field(ge=0, le=MAX_ID), BeforeValidator(_decimal)] | None = Field(
        default=None, alias="Last-Event-ID", description="Resume after this line id (wins over `after`).")


class WorkersQuery(Query):
    all: QueryBool = Field(default=False, description="Include stopped and stale workers.")


class TokenListQuery(Query):
    all: QueryBool = Field(default=False, description="Include revoked tokens.")


class CampaignListQuery(Query):
    limit: QueryInt = Field(default=20, ge=1, le=200, description="At most this many campaigns.")


class BlobQuery(Query):
    """A signed download URL's parameters; a URL that does not parse is as invalid as a wrong signature."""

    expires: QueryInt = Field(ge=0, le=10**12, description="Unix time the URL expires.")
    sig: str = Field(pattern="^[0-9a-fA-F]{64}$", description="HMAC-SHA256 signature, hex.")
    filename: str | None = Field(default=None, max_length=255, description="Download file name (signed).")


class UploadQuery(Query):
    sha256: Sha256Hex | None = Field(default=None, description="Expected sha256 of the body, as 64 hex digits; "
                                     "verified like Content-Digest.")


class UploadHeaders(Headers):
    content_digest: HeaderText | None = Field(
        default=None, alias="Content-Digest",
        description="RFC 9530 digest of the body, e.g. `sha-256=:<base64>:`. Only `sha-256` is verified (others "
                    "are ignored); a mismatch is a 400 and nothing is stored.")
    digest: HeaderText | None = Field(default=None, alias="Digest",
                                      description="Legacy RFC 3230 form, `sha-256=<base64>`; verified like "
                                                  "Content-Digest.")


# -- reading -------------------------------------------------------------------------------------------------

@functools.cache
def _names(model: type[BaseModel]) -> dict[str, bool]:
    """Parameter name (the alias, if any) -> whether it takes a list."""
    return {field.alias or name: typing.get_origin(field.annotation) is list
            for name, field in model.model_fields.items()}


def invalid(field: str, message: str, code: str = "invalid-request") -> Problem:
    return Problem(code, f"{field}: {message}", errors=[{"field": field, "message": message}])


def _problem(exc: ValidationError, prefix: str, code: str) -> Problem:
    errors = [{**e, "field": f"{prefix}{e['field']}"} for e in validation_errors(exc)]
    first = errors[0] if errors else {"field": prefix.strip(), "message": "invalid"}
    return Problem(code, f"{first['field']}: {first['message']}", errors=errors)


def read_query(model: type[M], code: str = "invalid-request") -> M:
    """The query string as ``model``; ``code`` (400 ``invalid-request`` unless the endpoint says otherwise)
    names each bad parameter."""
    names = _names(model)
    values: dict[str, Any] = {}
    args = request.args
    for name in args:
        items = args.getlist(name)
        if any("\x00" in item for item in items):
            raise invalid(name if "\x00" not in name else "query", "must not contain NUL characters", code)
        if name not in names:
            continue
        if names[name]:
            values[name] = items
        elif len(items) > 1:
            raise invalid(name, "given more than once", code)
        else:
            values[name] = items[0]
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        raise _problem(exc, "", code) from None


def read_headers(model: type[M]) -> M:
    """The headers ``model`` declares; a blank header counts as absent, and repeated field lines are one
    comma-separated list (RFC 9110, 5.3)."""
    values: dict[str, str] = {}
    for name in _names(model):
        lines = [line.strip() for line in request.headers.getlist(name) if line.strip()]
        if lines:
            values[name] = ", ".join(lines)
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        raise _problem(exc, "header ", "invalid-request") from None


def has_nul_in_query() -> bool:
    if not request.query_string:
        return False
    return any("\x00" in key or "\x00" in value for key, value in request.args.items(multi=True))
