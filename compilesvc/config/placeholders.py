"""Placeholder secrets are refused at start: a deployment that kept docker-compose.yml's or
docker/env.example's ``change-me…`` values (or any other value saying "change me") runs with secrets
everybody who read the repository knows.

Owns :func:`placeholders`: which of the secrets a compilesvc process gets (its settings, and the
``PGPASSWORD`` / ``AWS_SECRET_ACCESS_KEY`` that libpq and boto3 read from the environment) are
placeholders. :class:`compilesvc.config.settings.Settings` refuses to build with any, unless
``COMPILESVC_ALLOW_PLACEHOLDER_SECRETS=true`` says this is a development stack on purpose.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from urllib.parse import unquote, urlsplit

#: "change-me", "changeme", "CHANGE_ME", "change-me-s3-secret-key"...
PLACEHOLDER_RE = re.compile(r"change[-_ ]?me", re.IGNORECASE)

#: Secrets read from the environment by the libraries compilesvc hands its connections to.
ENVIRONMENT_SECRETS = ("PGPASSWORD", "AWS_SECRET_ACCESS_KEY")


def _url_password(url: str | None) -> str:
    if not url:
        return ""
    try:
        return unquote(urlsplit(url).password or "")
    except ValueError:
        return ""


def placeholders(secrets: Mapping[str, str | None], environ: Mapping[str, str]) -> list[str]:
    """The names (``COMPILESVC_…`` or environment variables) whose value is a placeholder, sorted.
    ``secrets`` maps setting names to values; a URL counts by its password."""
    found = []
    for name, value in secrets.items():
        text = _url_password(value) if name.endswith("_url") else (value or "")
        if PLACEHOLDER_RE.search(text):
            found.append(f"COMPILESVC_{name.upper()}")
    found.extend(name for name in ENVIRONMENT_SECRETS if PLACEHOLDER_RE.search(environ.get(name, "")))
    return sorted(found)


def refusal(names: list[str]) -> str:
    verb = "holds" if len(names) == 1 else "hold"
    return (f"{', '.join(names)} still {verb} a placeholder ('change-me'): set real secrets (docs/deploy.md, "
            "\"Secrets\"), or COMPILESVC_ALLOW_PLACEHOLDER_SECRETS=true for a development stack")
