"""A fleet naming its artifact by spec accepts only that spec's artifact: a lying resolve answer (online) or a
poisoned ``specs/`` entry of the cache (online and offline) naming another validly signed artifact is refused,
by ``ArtifactSet.open`` and by ``compilesvc fetch --spec`` (exit status 3), before a file of it is used."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from compilesvc.cli.main import main as cli
from compilesvc.fleet import ArtifactSet, NotTheSpec
from compilesvc.fleet._fetch import spec_digest
from compilesvc.fleet._remote import Remote
from tests.fleet.conftest import FleetApi
from tests.web.support import spec_for


def _two_artifacts(api: FleetApi) -> tuple[dict[str, Any], str, str]:
    """The spec of one published artifact, its key, and the key of another (another model) published beside it."""
    mine = api.publish(model=b"mine")
    theirs = api.publish(model=b"another team's")
    return spec_for(api.env.upload(b"mine")), mine, theirs


def _lie(monkeypatch: pytest.MonkeyPatch, key: str) -> None:
    """The resolve answer rewritten on its way (a proxy), naming ``key`` as published."""
    monkeypatch.setattr(Remote, "resolve", lambda self, spec: (key, "published"))


def _fetch(api: FleetApi, *args: str) -> Any:
    env = {k: v for k, v in api.environ().items() if k.startswith("COMPILESVC_")}
    return CliRunner().invoke(cli, ["fetch", *args], env=env, catch_exceptions=False)


def test_a_lying_resolve_answer_is_refused(fleet_api: FleetApi, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    spec, mine, theirs = _two_artifacts(fleet_api)
    _lie(monkeypatch, theirs)
    with pytest.raises(NotTheSpec) as refused:
        ArtifactSet.open(spec, cache_dir=tmp_path / "lib", api_url=fleet_api.base, token=fleet_api.token)
    message = str(refused.value)
    assert f"{theirs} (the API's resolve answer) is a validly signed artifact, but not this spec's" in message
    assert "differs in model.sha256" in message and f"the spec's key would be {mine}" in message
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec))
    result = _fetch(fleet_api, "--spec", str(spec_file))
    assert result.exit_code == 3, result.output
    assert "refused:" in result.output and "not this spec's" in result.output and "model.sha256" in result.output
    # The honest answer is taken.
    monkeypatch.undo()
    assert ArtifactSet.open(spec, cache_dir=tmp_path / "lib", api_url=fleet_api.base, token=fleet_api.token).key == mine


def _document(spec: dict[str, Any]) -> dict[str, Any]:
    from compilesvc.spec.parsing import parse_spec

    document: dict[str, Any] = parse_spec(dict(spec), limits=None, extra_flags=None).model_dump(
        mode="json", exclude_none=True)
    document.pop("callbacks", None)
    return document


@pytest.mark.parametrize("offline", [False, True], ids=["online", "offline"])
def test_a_poisoned_specs_entry_is_refused(fleet_api: FleetApi, tmp_path: Path, offline: bool) -> None:
    spec, mine, theirs = _two_artifacts(fleet_api)
    cache = tmp_path / "lib"
    for ref in (spec, theirs):  # both in the cache, the spec remembered
        ArtifactSet.open(ref, cache_dir=cache, api_url=fleet_api.base, token=fleet_api.token)
    entry = cache / "v1" / "specs" / spec_digest(_document(spec))
    assert entry.read_text().strip() == mine
    entry.write_text(theirs + "\n")  # a write to a shared cache
    online = {} if offline else {"api_url": fleet_api.base, "token": fleet_api.token}
    with pytest.raises(NotTheSpec, match=f"{theirs} \\(the cache's entry {entry}\\) is a validly signed artifact, but "
                                         "not this spec's"):
        ArtifactSet.open(spec, cache_dir=cache, offline=offline, **online)  # type: ignore[arg-type]
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec))
    result = _fetch(fleet_api, "--spec", str(spec_file), "--cache-dir", str(cache), *(["--offline"] if offline else []))
    assert result.exit_code == 3 and "not this spec's" in result.output, result.output


def test_the_spec_s_own_target_sdk_buckets_and_flags_are_compared(fleet_api: FleetApi, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    key = fleet_api.publish(model=b"m")
    uri = fleet_api.env.upload(b"m")
    _lie(monkeypatch, key)
    for other, differs in [(spec_for(uri, buckets=((1, 8),)), "buckets"),
                           (spec_for(uri, sdk="2.12.0"), "toolchain.sdk"),
                           ({**spec_for(uri), "compiler": {"args": ["--freeze"]}}, "flags")]:
        with pytest.raises(NotTheSpec, match=f"differs in [^;]*{differs}"):
            ArtifactSet.open(other, cache_dir=tmp_path / "lib", api_url=fleet_api.base, token=fleet_api.token)
