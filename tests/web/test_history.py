"""GET /v1/builds (keyset pagination, filters, next links) and the UI pages over the same data."""

from __future__ import annotations

import re
import urllib.parse
from typing import Any

import pytest

from tests.fixtures.tokens import bearer, make_token
from tests.web.support import PUBLIC_URL, Env, complete_build, fail_build, spec_for
from tests.web.test_submit import assert_problem
from web.contract.schemas import BuildList

EnvFactory = Any


def populate(env: Env) -> dict[str, list[int]]:
    """Nine builds over three targets, two submitters, labels and every terminal state."""
    cpu_uri = env.upload(b"cpu model")
    inf_uri = env.upload(b"neuron model")
    ids: dict[str, list[int]] = {"cpu": [], "inf2": [], "trn1": []}
    cpu = spec_for(cpu_uri, labels={"team": "vision"})
    alice, bob = (make_token(env.services.sessions, "submit", owner=name) for name in ("alice", "bob"))
    for _ in range(4):
        ids["cpu"].append(env.submit(cpu, **bearer(alice)).json["build_id"])
    inf = spec_for(inf_uri, target="inf2", sdk="2.20.0", labels={"team": "nlp", "ticket": "a:b"}, name="bert")
    for _ in range(3):
        ids["inf2"].append(env.submit(inf, **bearer(bob)).json["build_id"])
    trn = spec_for(inf_uri, target="trn1", sdk="2.21.0", name="other-model", buckets=((4, 4),))
    for _ in range(2):
        ids["trn1"].append(env.submit(trn).json["build_id"])
    complete_build(env.services, ids["cpu"][0])  # all four cpu builds succeed together
    fail_build(env.services, ids["trn1"][0])      # both trn1 builds fail
    assert env.client.post(f"/v1/builds/{ids['inf2'][2]}/cancel").status_code == 200
    return ids


def page_through(env: Env, url: str) -> list[int]:
    seen: list[int] = []
    while url:
        response = env.client.get(url.removeprefix(PUBLIC_URL))
        assert response.status_code == 200, response.json
        page = BuildList.model_validate(response.json)
        seen += [item.build_id for item in page.items]
        if page.next is not None:
            assert response.headers["Link"] == f'<{page.next}>; rel="next"'
            assert page.next_cursor is not None
        else:
            assert "Link" not in response.headers
        url = page.next or ""
    return seen


def test_pagination_and_filters(env: Env) -> None:
    ids = populate(env)
    everything = sorted(ids["cpu"] + ids["inf2"] + ids["trn1"], reverse=True)
    assert page_through(env, "/v1/builds?limit=2") == everything
    assert page_through(env, "/v1/builds") == everything

    def listed(query: str) -> list[int]:
        return page_through(env, f"/v1/builds?limit=2&{query}")

    assert listed("target=inf2") == sorted(ids["inf2"], reverse=True)
    assert listed("sdk=2.21.0") == sorted(ids["trn1"], reverse=True)
    assert listed("state=succeeded") == sorted(ids["cpu"], reverse=True)
    assert listed("state=failed") == sorted(ids["trn1"], reverse=True)
    assert listed("state=cancelled") == [ids["inf2"][2]]
    assert listed("label=team:vision") == sorted(ids["cpu"], reverse=True)
    assert listed("label=" + urllib.parse.quote("ticket:a:b")) == sorted(ids["inf2"], reverse=True)
    assert listed("submitted_by=bob") == sorted(ids["inf2"], reverse=True)
    assert listed("model=other-model") == sorted(ids["trn1"], reverse=True)
    sha = env.client.get(f"/v1/builds/{ids['cpu'][0]}").json["model_sha256"]
    assert listed(f"model={sha}") == sorted(ids["cpu"], reverse=True)
    assert listed("target=inf2&state=building&submitted_by=bob") == sorted(ids["inf2"][:2], reverse=True)
    assert listed("target=cpu&submitted_by=bob") == []
    assert listed("target=&sdk=") == sorted(ids["cpu"] + ids["inf2"] + ids["trn1"], reverse=True)

    item = env.client.get("/v1/builds?limit=1").json["items"][0]
    assert item["status_url"] == f"{PUBLIC_URL}/v1/builds/{item['build_id']}"


@pytest.mark.parametrize("query, kind, field", [
    ("cursor=garbage!", "invalid-cursor", None),
    ("cursor=MA", "invalid-cursor", None),
    ("limit=0", "invalid-request", "limit"),
    ("limit=201", "invalid-request", "limit"),
    ("limit=ten", "invalid-request", "limit"),
    ("label=nocolon", "invalid-request", "label"),
    ("state=bogus", "invalid-request", "state"),
    ("target=" + "x" * 17, "invalid-request", "target"),
    ("target=a%00b", "invalid-request", "target"),
])
def test_bad_history_queries_are_400(sqlite_env: Env, query: str, kind: str, field: str | None) -> None:
    body = assert_problem(sqlite_env.client.get(f"/v1/builds?{query}"), 400, kind)
    if field is not None:
        assert body["errors"][0]["field"] == field


def test_ui_history_and_detail(make_env: EnvFactory, sqlite_url: str) -> None:
    env = make_env(sqlite_url, config={"UI_PAGE_SIZE": 3})
    ids = populate(env)
    first = env.client.get("/")
    assert first.status_code == 200 and first.mimetype == "text/html"
    html = first.get_data(as_text=True)
    newest = sorted(ids["cpu"] + ids["inf2"] + ids["trn1"], reverse=True)
    for build_id in newest[:3]:
        assert f'href="/builds/{build_id}"' in html
    assert f'href="/builds/{newest[3]}"' not in html
    next_link = re.search(r'<a href="([^"]+)">Older', html)
    assert next_link is not None
    second = env.client.get(next_link.group(1).replace("&amp;", "&")).get_data(as_text=True)
    assert f'href="/builds/{newest[3]}"' in second and "Newest" in second

    filtered = env.client.get("/?target=inf2&submitted_by=bob").get_data(as_text=True)
    assert all(f'href="/builds/{i}"' in filtered for i in ids["inf2"])
    assert f'href="/builds/{ids["cpu"][0]}"' not in filtered
    assert 'value="bob"' in filtered

    bad = env.client.get("/?cursor=nope")
    assert bad.status_code == 400 and "malformed cursor" in bad.get_data(as_text=True)
    assert env.client.get("/?label=x").status_code == 400

    succeeded = env.client.get(f"/builds/{ids['cpu'][0]}").get_data(as_text=True)
    assert "/v1/blobs/" in succeeded and "model.pt" in succeeded  # download links
    assert 'data-stream="/v1/builds/' in succeeded and "EventSource" not in succeeded  # JS is a file
    assert "batch_size" not in succeeded and "input_ids: int64[1, 8]" in succeeded

    failed = env.client.get(f"/builds/{ids['trn1'][0]}").get_data(as_text=True)
    assert "unsupported operator aten::foo" in failed and "NCC_EXTP004" in failed
    retry_form = f'<form method="post" action="/builds/{ids["trn1"][0]}/retry">'
    assert retry_form in failed and 'name="csrf_token"' in failed and "Retry" in failed

    missing = env.client.get("/builds/999999", headers={"Accept": "text/html,*/*;q=0.8"})
    assert missing.status_code == 404 and missing.mimetype == "text/html"
    assert env.client.get("/builds/999999").mimetype == "application/problem+json"
    assert env.client.get("/static/build.js").status_code == 200
    assert env.client.get("/static/style.css").status_code == 200
