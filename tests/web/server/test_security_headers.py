"""The security headers on every HTML and JSON answer (web/server/security_headers.py), the pages fit the CSP (no
inline script, style or handler in anything they render), and the nginx template sets the same headers on
its own answers without doubling the API's (a real nginx in front of a real ``compilesvc serve``)."""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path

import pytest
import requests

from tests.fixtures.nginx import nginx_binary, nginx_proxy
from tests.fixtures.ports import free_port
from tests.fixtures.serve import BOOTSTRAP_TOKEN, compilesvc_serve
from tests.web.support import Env, complete_build, fail_build, spec_for
from tests.web.test_auth import csrf_of, login
from web.server.security_headers import CONTENT_SECURITY_POLICY

FIXED = {
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}


def assert_secure(headers: requests.structures.CaseInsensitiveDict[str] | object, *, cached: bool = False) -> None:
    get = headers.get  # type: ignore[attr-defined]
    csp = get("Content-Security-Policy")
    assert csp is not None
    directives = dict(part.strip().split(" ", 1) for part in csp.split(";"))
    assert directives["frame-ancestors"] == "'none'" and directives["default-src"] == "'none'"
    assert "'unsafe-inline'" not in csp and "'unsafe-eval'" not in csp and "*" not in csp
    for name, value in FIXED.items():
        assert get(name) == value, (name, get(name))
    if not cached:
        assert get("Cache-Control") == "no-store"


class InlineFinder(HTMLParser):
    """Everything on a page that a CSP without 'unsafe-inline' would block."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        names = {name for name, _ in attrs}
        if "style" in names:
            self.found.append(f"<{tag} style=…>")
        self.found.extend(f"<{tag} {name}=…>" for name in names if name.startswith("on"))
        if tag == "style":
            self.found.append("<style>")
        if tag == "script" and "src" not in names:
            self.found.append("<script> without src")
        for name, value in attrs:
            if name in ("href", "src", "action") and (value or "").strip().lower().startswith("javascript:"):
                self.found.append(f"<{tag} {name}=javascript:…>")


def inline_parts(html: str) -> list[str]:
    finder = InlineFinder()
    finder.feed(html)
    return finder.found


def test_every_page_and_answer_carries_the_headers_and_no_inline_code(env: Env) -> None:
    spec = spec_for(env.upload())
    done = env.submit(spec).json["build_id"]
    complete_build(env.services, done)
    failed = env.submit(spec_for(env.upload(b"another model"))).json["build_id"]
    fail_build(env.services, failed)
    browser = env.app.test_client()
    login_page = browser.get("/login")
    assert_secure(login_page.headers)
    assert login(browser, env.token).status_code == 303

    pages = ["/", f"/builds/{done}", f"/builds/{failed}", "/artifacts", "/workers", "/campaigns", "/stats", "/docs",
             "/login", "/?label=x:y"]
    for path in pages:
        answer = browser.get(path)
        assert answer.status_code == 200 and answer.mimetype == "text/html", path
        assert_secure(answer.headers)
        assert inline_parts(answer.get_data(as_text=True)) == [], path
    assert_secure(browser.get(f"/builds/{done}/log.txt").headers)

    api = [env.client.get("/v1/builds"), env.client.get(f"/v1/builds/{done}"), env.client.get("/healthz"),
           env.client.get("/openapi.json"), env.client.get("/v1/builds/999999"),  # a problem (404)
           env.app.test_client().get("/v1/builds"),  # refused (401)
           env.client.post("/v1/builds", data="x", content_type="text/plain"),  # refused (415)
           env.client.get("/v1/no/such/path"), env.client.delete("/v1/builds")]  # no route (404), 405
    for answer in api:
        assert answer.mimetype in ("application/json", "application/problem+json"), answer.mimetype
        assert_secure(answer.headers)

    # Logging out is a change made with the cookie: its redirect is no-store too.
    out = browser.post("/logout", data={"csrf_token": csrf_of(browser, "/")})
    assert out.status_code == 303 and out.headers["Cache-Control"] == "no-store"


def test_static_files_are_public_and_keep_their_own_caching(sqlite_env: Env) -> None:
    for name, mimetype in (("style.css", "text/css"), ("ui.js", "text/javascript"), ("build.js", "text/javascript")):
        answer = sqlite_env.app.test_client().get(f"/static/{name}")
        assert answer.status_code == 200 and answer.mimetype == mimetype
        assert answer.headers["X-Content-Type-Options"] == "nosniff"
        assert answer.headers.get("Cache-Control") != "no-store"


def test_the_templates_and_static_files_have_nothing_inline() -> None:
    web = Path(__file__).resolve().parents[3] / "web"
    for template in (web / "templates").glob("*.html"):
        text = template.read_text()
        # The rendered pages are checked above; this catches a branch the test data did not reach.
        assert " style=" not in text and "<style" not in text and "javascript:" not in text, template.name
        assert all("src=" in tag for tag in text.split("<script")[1:]), template.name
    for script in (web / "static").glob("*.js"):
        text = script.read_text()
        assert "eval(" not in text and "new Function" not in text and ".innerHTML" not in text, script.name


def test_the_policy_is_the_documented_one() -> None:
    assert "frame-ancestors 'none'" in CONTENT_SECURITY_POLICY
    template = (Path(__file__).resolve().parents[3] / "docker" / "nginx" / "compilesvc.conf.template").read_text()
    assert f'"{CONTENT_SECURITY_POLICY}"' in template  # nginx's own answers carry the same policy


def test_the_proxy_adds_the_headers_once(tmp_path: Path) -> None:
    nginx_binary()  # skips with a message where nginx is missing
    port = free_port()
    with compilesvc_serve(tmp_path, workers=1) as api, nginx_proxy(tmp_path / "nginx", port,
                                                                     f"127.0.0.1:{api.port}") as proxy:
        auth = {"Authorization": f"Bearer {BOOTSTRAP_TOKEN}"}
        for path, headers in (("/v1/builds", auth), ("/healthz", {}), ("/login", {}), ("/v1/builds", {})):
            answer = requests.get(proxy.base + path, headers=headers, timeout=10)
            assert_secure(answer.headers)
            raw = answer.raw.headers  # urllib3's: each header line as sent
            for name in (*FIXED, "Content-Security-Policy", "Cache-Control"):
                assert len(raw.getlist(name)) == 1, (path, name, raw.getlist(name))
        static = requests.get(proxy.base + "/static/style.css", timeout=10)
        assert static.headers.get("Cache-Control") != "no-store" and static.headers["X-Frame-Options"] == "DENY"
    # With the API gone: nginx's own problem answer (502) carries them, and its Retry-After.
    with nginx_proxy(tmp_path / "nginx2", free_port(), f"127.0.0.1:{free_port()}") as proxy:
        down = requests.get(proxy.base + "/v1/builds", timeout=10)
        assert down.status_code == 502 and down.headers["Retry-After"] == "5"
        assert_secure(down.headers)
        assert requests.get(proxy.base + "/healthz", timeout=10).headers["Content-Security-Policy"] == \
            CONTENT_SECURITY_POLICY


@pytest.mark.parametrize("path", ["/v1/builds", "/"])
def test_refusals_carry_them_too(sqlite_env: Env, path: str) -> None:
    answer = sqlite_env.app.test_client().get(path)
    assert answer.status_code in (303, 401)
    assert_secure(answer.headers)
