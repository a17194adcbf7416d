"""The engineers' pages over real ledgers: history with cache outcome, duration and error; a build's
provenance, remembered failure, miss explanation, failure logs and full log; artifacts; workers. The
browser suite (tests/ui) clicks through the same pages in Chromium."""

from __future__ import annotations

import re
from typing import Any

from compilesvc.compiles import leases
from compilesvc.dispatch.registry import mark_draining, register
from compilesvc.ledger.engine import transaction
from compilesvc.ledger.models import Build
from tests.fixtures.tokens import bearer, make_token
from tests.web.support import Env, complete_build, fail_build, queued_buckets, spec_for
from web.contract.schemas import MissOut

EnvFactory = Any


def text_of(html: str) -> str:
    """The page's text as a reader sees it: tags dropped, whitespace collapsed."""
    return " ".join(re.sub(r"<[^>]+>", " ", html).split())


def page(env: Env, url: str, status: int = 200) -> str:
    response = env.client.get(url)
    assert response.status_code == status, response.get_data(as_text=True)[:2000]
    return response.get_data(as_text=True)


def scenario(env: Env) -> dict[str, int]:
    """Built, joined, partly reused, hit, a compile error and the build that joined it."""
    uri = env.upload(b"bert weights")
    spec = spec_for(uri, name="bert", labels={"team": "search"})
    built = env.submit(spec).json["build_id"]
    joined = env.submit(spec).json["build_id"]
    complete_build(env.services, built, log_lines=("tracing bert", "saved model.pt"))
    bigger = env.submit(spec_for(uri, name="bert", buckets=((1, 8), (2, 8), (4, 64)))).json["build_id"]
    complete_build(env.services, bigger)
    hit = env.submit(spec).json["build_id"]
    broken = spec_for(env.upload(b"broken model"), name="broken")
    failed = env.submit(broken).json["build_id"]
    fail_build(env.services, failed, code="CPU_TRACE_ERROR", message="aten::foo has no lowering " + "x" * 600,
               log_lines=("[compile-child] tracing", "Traceback (most recent call last):",
                          "RuntimeError: aten::foo has no lowering"))
    remembered = env.submit(broken).json["build_id"]
    return {"built": built, "joined": joined, "bigger": bigger, "hit": hit, "failed": failed,
            "remembered": remembered}


def row_of(html: str, build_id: int) -> str:
    match = re.search(rf'<tr id="build-{build_id}"[^>]*>(.*?)</tr>', html, re.S)
    assert match is not None, f"no row for build {build_id}"
    return text_of(match.group(1))


def test_history_shows_cache_outcome_duration_and_error(make_env: EnvFactory, sqlite_url: str) -> None:
    env = make_env(sqlite_url)
    ids = scenario(env)
    html = page(env, "/")
    assert "built" in row_of(html, ids["built"]) and "joined" in row_of(html, ids["joined"])
    assert "partly reused (2 of 3)" in row_of(html, ids["bigger"])
    assert " hit " in f" {row_of(html, ids['hit'])} "
    failed = row_of(html, ids["failed"])
    assert "compile CPU_TRACE_ERROR" in failed and "aten::foo has no lowering" in failed
    assert "joined a remembered failure" in row_of(html, ids["remembered"])
    assert re.search(r"\d+(\.\d)? s", row_of(html, ids["built"]))  # a duration
    # Inputs and other tokens never break inside: each input is one unbreakable span.
    build_html = page(env, f"/builds/{ids['built']}")
    assert '<span class="nowrap">input_ids: int64[1, 8]</span>' in build_html

    two = page(env, "/?limit=2")
    assert len(re.findall(r'<tr id="build-', two)) == 2
    older = re.search(r'<a href="([^"]+)">Older', two)
    assert older is not None and "limit=2" in older.group(1)
    assert len(re.findall(r'<tr id="build-', page(env, older.group(1).replace("&amp;", "&")))) == 2
    assert "limit: a whole number from 1 to 200" in page(env, "/?limit=0", 400)
    assert page(env, "/?limit=9999", 400)

    env.submit(spec_for(env.upload(b"running"), name="running"))
    assert 'data-live' in page(env, "/")  # running rows refresh themselves


def cache_of(build_html: str) -> str:
    """What a build page's summary says under Cache."""
    match = re.search(r'<dt>Cache</dt><dd[^>]*>(.*?)</dd>', build_html, re.S)
    assert match is not None
    return text_of(match.group(1))


def test_a_build_page_and_the_history_say_the_same_about_the_cache(make_env: EnvFactory, sqlite_url: str) -> None:
    """Issue 27: a set that reused 2 of its 3 buckets read "new set" on its page and "partly reused (2 of 3)"
    in the history; both now take the words from compilesvc.builds.provenance.cache_outcome."""
    env = make_env(sqlite_url)
    ids = scenario(env)
    history = page(env, "/")
    for name, build_id in ids.items():
        listed = re.search(rf'<tr id="build-{build_id}".*?<td class="[^"]*\bcache\b[^"]*">(.*?)</td>', history, re.S)
        assert listed is not None and cache_of(page(env, f"/builds/{build_id}")) == text_of(listed.group(1)), name
    assert cache_of(page(env, f"/builds/{ids['bigger']}")) == "partly reused (2 of 3)"


def test_build_page_says_where_each_bucket_came_from(make_env: EnvFactory, sqlite_url: str) -> None:
    env = make_env(sqlite_url)
    ids = scenario(env)
    bigger = text_of(page(env, f"/builds/{ids['bigger']}"))
    assert bigger.count(f"reused from build {ids['built']}") >= 2 and "compiled by this build" in bigger
    assert "bucket input_ids: int64[4, 64], attention_mask: int64[4, 64] is new" in bigger

    hit = page(env, f"/builds/{ids['hit']}")
    assert f'href="/builds/{ids["built"]}"' in hit and cache_of(hit) == "hit"
    # A hit shows no compile log as its own: it points at the builds whose compiles it reused.
    assert 'id="log"' not in hit and f'href="/builds/{ids["built"]}#compile-log"' in hit
    assert "Lines of buckets 0, 1 are from the earlier compiles this build reused" in text_of(
        page(env, f"/builds/{ids['bigger']}"))
    joined = text_of(page(env, f"/builds/{ids['joined']}"))
    assert f"joined the compile of build {ids['built']}" in joined

    remembered = page(env, f"/builds/{ids['remembered']}")
    words = text_of(remembered)
    assert "joined a failure remembered from an earlier build" in words
    assert f"failed in build {ids['failed']}" in words and "CPU_TRACE_ERROR" in words
    assert f'action="/builds/{ids["remembered"]}/retry"' in remembered  # the admin may retry
    # The whole message (not 500 characters of it) and the compiler's own last lines.
    assert "x" * 600 in remembered and "RuntimeError: aten::foo has no lowering" in words
    archived = re.search(r'<a href="([^"]+)" download>attempt 1</a>', remembered)
    assert archived is not None
    download = env.client.get(archived.group(1).replace("&amp;", "&").removeprefix("http://api.test"))
    assert download.status_code == 200 and b"RuntimeError: aten::foo" in download.data

    log = env.client.get(f"/builds/{ids['built']}/log.txt")
    assert log.status_code == 200 and log.mimetype == "text/plain"
    assert re.search(r"^\d\d:\d\d:\d\d \[0\] #1 tracing bert$", log.get_data(as_text=True), re.M)
    assert env.client.get("/builds/999999/log.txt").status_code == 404

    miss = env.client.get(f"/v1/builds/{ids['bigger']}/miss")
    assert miss.status_code == 200
    body = MissOut.model_validate(miss.json)
    assert body.compared_with is not None and body.compared_with.build_id == ids["joined"]  # the newest earlier asker
    assert [c.text for c in body.changes] == ["bucket input_ids: int64[4, 64], attention_mask: int64[4, 64] is new"]
    assert env.client.get("/v1/builds/999999/miss").status_code == 404


def test_a_read_token_sees_no_buttons_and_a_team_submitter_does(make_env: EnvFactory, sqlite_url: str) -> None:
    env = make_env(sqlite_url)
    submitter = make_token(env.services.sessions, "submit", owner="ann", team="search")
    build_id = env.submit(spec_for(env.upload()), **bearer(submitter)).json["build_id"]
    for token, shown in ((make_token(env.services.sessions, "read", owner="eve"), False), (submitter, True),
                         (make_token(env.services.sessions, "submit", owner="bob", team="other"), False)):
        html = env.client.get(f"/builds/{build_id}", headers=bearer(token)).get_data(as_text=True)
        assert ("Cancel build" in html) is shown


def test_artifacts_page_groups_by_model_with_usage_and_pins(make_env: EnvFactory, sqlite_url: str) -> None:
    env = make_env(sqlite_url)
    ids = scenario(env)
    with env.services.sessions() as session:
        key = session.get_one(Build, ids["built"]).artifact_key
    assert env.client.post("/v1/pins", json={"kind": "artifact", "value": key}).status_code in (200, 201)
    for _ in range(3):
        assert env.client.get(f"/v1/artifacts/{key}").status_code == 200
    env.app.extensions["compilesvc"].fetches.flush()
    html = page(env, "/artifacts")
    words = text_of(html)
    assert "bert" in words and "broken" in words
    row = re.search(rf'<tr id="artifact-{key[:16]}">(.*?)</tr>', html, re.S)
    assert row is not None
    cells = text_of(row.group(1))
    assert "published" in cells and "pinned" in cells and " 3 " in f" {cells} " and "never" not in cells
    only_bert = text_of(page(env, "/artifacts?model=bert"))
    assert "broken" not in only_bert and "bert" in only_bert
    failed_only = page(env, "/artifacts?state=failed")
    states = re.findall(r'<span class="badge state-(\w+)">', failed_only.split("<table", 1)[1])
    assert states == ["failed"]  # the broken model's artifact, alone
    assert page(env, "/artifacts?state=nonsense", 400)
    assert page(env, "/artifacts?before=x", 400)


def test_workers_page_shows_capabilities_running_work_and_unserved_queues(make_env: EnvFactory,
                                                                          sqlite_url: str) -> None:
    env = make_env(sqlite_url, require_live_worker=False)
    build_id = env.submit(spec_for(env.upload())).json["build_id"]
    with transaction(env.services.sessions) as session:
        register(session, "trn2-host-1", "ip-10-0-0-7", {
            "targets": ["trn2"], "sdk": {"trn2": "2.21.0"}, "backends": {"trn2": ["neuronx-cc", "trace"]},
            "instance_type": "trn2.48xlarge", "neuron": {"packages": {"neuronx-cc": "2.16.372.0"}},
        }, ["compile.trn2.2.21.0.neuronx-cc"], 2)
    html = page(env, "/workers")
    words = text_of(html)
    assert "trn2-host-1" in words and "trn2.48xlarge" in words and "neuronx-cc 2.16.372.0" in words
    assert "trn2 2.21.0" in words and "idle" in words
    # The cpu build's queue has no live worker: a clear warning with what waits on it.
    assert "No live worker serves the queue" in words and "2 compiles wait on it" in words, words
    assert f"build {build_id}" not in words  # nothing runs yet

    with transaction(env.services.sessions) as session:
        assert leases.claim(session, queued_buckets(env.services, build_id)[0], "trn2-host-1",
                            lease_seconds=60) is not None
    assert f"build {build_id}" in text_of(page(env, "/workers"))
    # Told to stop: still live (it heartbeats while it drains), shown as draining.
    assert "draining" not in text_of(page(env, "/workers"))
    with transaction(env.services.sessions) as session:
        mark_draining(session, "trn2-host-1")
    assert "trn2-host-1 draining" in text_of(page(env, "/workers"))


def test_build_page_shows_the_verified_provenance(make_env: EnvFactory, sqlite_url: str) -> None:
    env = make_env(sqlite_url)
    submitted = env.submit(spec_for(env.upload(b"provenance model"), buckets=((1, 8), (2, 8))))
    build_id = submitted.json["build_id"]  # type: ignore[index]
    assert "Provenance" not in page(env, f"/builds/{build_id}")  # nothing published yet
    complete_build(env.services, build_id, versions={"torch": "2.13.0", "compilesvc": "0.1.0"})
    html = page(env, f"/builds/{build_id}")
    words = text_of(html)
    signer = env.services.signer
    assert signer is not None
    assert f"key {signer.key.key_id[:16]}… (this service's signing key); verified" in words
    assert f"Builder {env.services.settings.public_url}" in words
    assert "pkg:pypi/torch@2.13.0" in words
    artifact = env.client.get(f"/v1/artifacts/{submitted.json['artifact_key']}").json  # type: ignore[index]
    for bucket in artifact["buckets"]:
        assert f"bucket-{bucket['position']}/model.pt {bucket['files'][0]['sha256']}" in words
    assert f'href="/v1/artifacts/{submitted.json["artifact_key"]}/provenance"' in html  # type: ignore[index]

    # A provenance document the service did not sign is not shown as its provenance.
    from compilesvc.signing.keys import SigningKey
    from compilesvc.store.base import artifact_provenance_name

    name = artifact_provenance_name(submitted.json["artifact_key"])  # type: ignore[index]
    forged = SigningKey.load_or_generate(env.services.settings.data_dir / "forger" / "key.pem").sign(
        {"_type": "https://in-toto.io/Statement/v1", "subject": [], "predicateType": "x", "predicate": {}})
    env.services.store.delete_document(name)
    env.services.store.create_document(name, forged)
    refused = text_of(page(env, f"/builds/{build_id}"))
    assert "No verified provenance" in refused and "which is not a trusted key" in refused


def test_the_target_filters_offer_every_target_a_spec_may_name(sqlite_env: Env) -> None:
    # Issue 28 (2): trn3 is a target (compilesvc.spec.compile_spec.Target); the history's and the artifacts'
    # filters list what a spec may name, and filtering by trn3 is a valid query (an empty list here).
    for url in ("/", "/artifacts"):
        html = page(sqlite_env, url)
        options = re.findall(r'<option value="([^"]*)"', html)
        assert {"inf2", "trn1", "trn2", "trn3", "cpu"} <= set(options), (url, options)
        page(sqlite_env, f"{url}?target=trn3")
