"""The web UI for engineers: server-rendered pages (Jinja, one CSS file, a little plain JavaScript, no
external assets), one module per page family: :mod:`.builds` (history, a build, cancel and retry),
:mod:`.fleet` (artifacts, workers), :mod:`.campaigns` (roll-forwards and standing policies), :mod:`.session`
(sign-in and out), :mod:`.stats` (service statistics in SVG charts), plus the template filters in
:mod:`.filters`.

The pages read through the same core functions as the JSON API, so the UI never shows something the API
would not. A browser signs in by pasting a token (:mod:`web.auth` re-checks it on every request); forms that
change something carry the session's CSRF token, and buttons are shown only to those allowed to press them.
"""

from __future__ import annotations

from flask import Blueprint

bp = Blueprint("ui", __name__, template_folder="../templates", static_folder="../static",
               static_url_path="/static")

# The page modules register their routes on ``bp``.
from web.ui import builds, campaigns, filters, fleet, session, stats  # noqa: E402, F401
