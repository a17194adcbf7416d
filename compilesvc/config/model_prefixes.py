"""The syntax of ``COMPILESVC_MODEL_S3_PREFIXES``: which S3 prefixes each team may name as its model, and the one
prefix-match rule (:meth:`S3Prefix.covers`). The decision for a request (whose team, what refusal) is
:mod:`compilesvc.pinning.model_sources`; this module is here, below the settings, so that every process checks the
setting when it starts.

A prefix is ``s3://bucket`` (the whole bucket), ``s3://bucket/dir/`` (everything under ``dir/``) or
``s3://bucket/name`` (the object ``name`` and everything under ``name/``: never ``name2`` nor ``name.bak``).
Buckets compare whole: ``s3://a`` never covers bucket ``ab``.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: The team whose prefixes every team (and a request without a token) may name.
EVERY_TEAM = "*"
# S3's bucket naming rules (what the spec's URI pattern accepts too): 3 to 63 of [a-z0-9.-], a letter or digit at
# either end.
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")


def has_dot_segment(key: str) -> bool:
    """Whether ``key`` has a ``.`` or ``..`` segment, also percent-encoded or between backslashes. S3 keeps such a
    key as it is, but an HTTP client, proxy or S3-compatible server on the way may resolve ``a/../b`` to ``b``:
    a prefix match on the text would then say nothing about the object read."""
    text = key
    for _ in range(3):  # %252e%252e -> %2e%2e -> ..
        decoded = urllib.parse.unquote(text)
        if decoded == text:
            break
        text = decoded
    return any(segment in (".", "..") for segment in re.split(r"[/\\]", text))


@dataclass(frozen=True)
class S3Prefix:
    """One allowed prefix: a bucket and a key prefix ("" for the whole bucket)."""

    bucket: str
    key_prefix: str

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.key_prefix}"

    def covers(self, bucket: str, key: str) -> bool:
        """Whether ``s3://bucket/key`` is under this prefix, at a boundary: the bucket equal, and the key equal to
        the prefix or continuing it after a "/" (its own when the prefix ends in one)."""
        if bucket != self.bucket:
            return False
        prefix = self.key_prefix
        if not prefix or prefix.endswith("/"):
            return key.startswith(prefix)
        return key == prefix or key.startswith(prefix + "/")


def parse_s3_prefix(text: str) -> S3Prefix:
    """``s3://bucket[/prefix]`` -> :class:`S3Prefix`; a ValueError names what is wrong."""
    if not isinstance(text, str) or not text.startswith("s3://"):
        raise ValueError(f"{text!r} is not an s3:// URI (s3://bucket/ or s3://bucket/prefix/)")
    bucket, _, key_prefix = text.removeprefix("s3://").partition("/")
    if not _BUCKET_RE.fullmatch(bucket):
        raise ValueError(f"{text!r} names no S3 bucket (3 to 63 of a-z, 0-9, '.' and '-')")
    if has_dot_segment(key_prefix) or "\x00" in key_prefix or "\n" in key_prefix:
        raise ValueError(f"{text!r}: a prefix has no '.' or '..' segment and no control characters")
    return S3Prefix(bucket, key_prefix)


def parse_model_prefixes(value: Mapping[str, Sequence[str]]) -> dict[str, tuple[S3Prefix, ...]]:
    """The setting's JSON (``{"vision": ["s3://vision-models/"], "*": ["s3://shared/"]}``) parsed; a ValueError
    names the bad team or entry."""
    out: dict[str, tuple[S3Prefix, ...]] = {}
    for team, prefixes in value.items():
        if not team or team != team.strip():
            raise ValueError(f"{team!r}: a team name, or \"*\" for every team")
        if isinstance(prefixes, str) or not isinstance(prefixes, Sequence):
            raise ValueError(f"team {team!r}: a list of s3:// prefixes, e.g. [\"s3://{team}-models/\"]")
        try:
            out[team] = tuple(parse_s3_prefix(text) for text in prefixes)
        except ValueError as exc:
            raise ValueError(f"team {team!r}: {exc}") from None
    return out
