"""The security headers of every answer: a strict Content-Security-Policy, no framing, no MIME sniffing, no
referrer to other sites, and ``Cache-Control: no-store`` unless the view chose its own caching.

Why each (OWASP Secure Headers Project; MDN's pages on each header):

- **CSP** allows only this origin's own script, style, images and connections, and nothing inline: the UI
  has no inline script or style (web/templates, web/static; the build page's timeline bars are SVG
  attributes, not ``style=``), so an injected ``<script>`` or ``style=`` would not run. ``form-action``
  keeps forms on this site, ``base-uri 'none'`` stops a ``<base>`` from re-rooting relative URLs, and
  ``frame-ancestors 'none'`` stops clickjacking (``X-Frame-Options: DENY`` says the same to old browsers).
- **X-Content-Type-Options: nosniff**: a browser treats an answer as the type it says (a build log
  served as text/plain never runs as HTML or script).
- **Referrer-Policy: same-origin**: a page's URL (a build id, a filter) never goes to another site with
  a click on one of its links, e.g. a presigned download URL.
- **Cache-Control: no-store** on pages and API answers: they carry builds, logs and CSRF tokens for one
  token's eyes, and a shared or back-button cache must not keep them. Views that chose their own caching
  keep it: static files (public), the artifact lookup (``private``, its manifest is immutable: the fleet's
  ETag path), signed blob downloads (content-addressed) and the log stream.

The nginx template (docker/nginx/compilesvc.conf.template) sets the same headers on its own answers.
"""

from __future__ import annotations

from flask import Flask, Response, request

#: One policy for pages and API answers (a JSON answer loads nothing, so the page policy costs it nothing).
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")

HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}

#: Endpoints whose answers are public files (they keep their own, cacheable, Cache-Control).
PUBLIC_FILES = frozenset({"ui.static"})


def _secure(response: Response) -> Response:
    for name, value in HEADERS.items():
        response.headers.setdefault(name, value)
    if request.endpoint not in PUBLIC_FILES and "Cache-Control" not in response.headers:
        response.headers["Cache-Control"] = "no-store"
    return response


def install(app: Flask) -> None:
    """Add the headers to every answer, refusals and errors included (problem answers pass through
    ``after_request`` too)."""
    app.after_request(_secure)
