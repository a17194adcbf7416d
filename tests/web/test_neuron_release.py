"""A Neuron spec's sdk must be a release in the release table (compilesvc/neuron_releases.json): the key holds
the exact toolchain the release resolves to, so an unknown release is a 422 naming it and the refresh command,
before anything is queued; releases that ship the same packages share one artifact."""

from __future__ import annotations

from tests.web.support import Env, spec_for
from tests.web.test_compiler_flags import builds
from tests.web.test_submit import assert_problem


def test_unknown_release_is_422_naming_it_and_the_refresh_command(sqlite_env: Env) -> None:
    env = sqlite_env
    spec = spec_for(env.upload(), sdk="2.99.0", target="trn2")
    for path in ("/v1/builds?queue_anyway=true", "/v1/artifacts/resolve"):
        body = assert_problem(env.client.post(path, json=spec), 422, "spec-invalid")
        assert body["errors"][0]["field"] == "sdk"
        message = body["errors"][0]["message"]
        assert "2.99.0" in message and "compilesvc neuron-releases refresh --from" in message
    assert builds(env) == 0


def test_releases_shipping_one_toolchain_share_the_artifact(sqlite_env: Env) -> None:
    env = sqlite_env
    uri = env.upload()
    first = env.submit(spec_for(uri, sdk="2.27.0", target="trn2"))
    second = env.submit(spec_for(uri, sdk="2.27.1", target="trn2"))
    other = env.submit(spec_for(uri, sdk="2.26.1", target="trn2"))
    assert first.status_code == second.status_code == other.status_code == 202, first.get_data(as_text=True)
    assert first.get_json()["artifact_key"] == second.get_json()["artifact_key"] != other.get_json()["artifact_key"]


def test_a_kind_of_compile_the_release_does_not_ship_is_422_naming_release_and_package(sqlite_env: Env) -> None:
    """SDK 2.32.0 ships neuronx-cc and no torch-neuronx (the SDK's n2-manifest.json, manifest_version 2.32.0):
    a trace spec for it has no worker that could ever exist, so it is refused before anything is queued
    (issue 28); an HLO spec for it is keyed and queued (here with queue_anyway: no worker in this test)."""
    env = sqlite_env
    uri = env.upload()
    trace = spec_for(uri, sdk="2.32.0", target="trn2")
    for path in ("/v1/builds?queue_anyway=true", "/v1/artifacts/resolve"):
        body = assert_problem(env.client.post(path, json=trace), 422, "spec-invalid")
        [error] = body["errors"]
        assert error["field"] == "compiler.backend"
        assert "Neuron SDK 2.32.0 ships no torch-neuronx" in error["message"]
    assert builds(env) == 0
    hlo = {**trace, "model": {"uri": uri, "format": "hlo", "name": "hlo"}}
    accepted = env.client.post("/v1/builds?queue_anyway=true", json=hlo)
    assert accepted.status_code == 202, accepted.get_data(as_text=True)


def test_a_bad_neuron_config_is_422_naming_the_field(sqlite_env: Env) -> None:
    """An hf-checkpoint spec's neuron_config is checked against the NxD Inference of its release before anything
    is uploaded, keyed or queued (issue 29): a misspelt field, which NxDI itself would only log, is a
    problem+json 422 naming neuron_config.<field> with a suggestion."""
    env = sqlite_env
    spec = {"model": {"uri": env.upload(), "format": "hf-checkpoint"}, "target": "trn2", "sdk": "2.29.1",
            "neuron_config": {"tp_degree": 8, "seq_len": 2048, "buckets": [128, 4096]}}
    for path in ("/v1/builds?queue_anyway=true", "/v1/artifacts/resolve"):
        body = assert_problem(env.client.post(path, json=spec), 422, "spec-invalid")
        [error] = body["errors"]
        assert error["field"] == "neuron_config.buckets[1]"
        assert "bucket 4096 is above seq_len/max_length 2048" in error["message"]
    misspelt = {**spec, "neuron_config": {"tp_degre": 8}}
    body = assert_problem(env.client.post("/v1/builds?queue_anyway=true", json=misspelt), 422, "spec-invalid")
    assert body["errors"] == [{"field": "neuron_config.tp_degre", "message": body["errors"][0]["message"]}]
    assert "did you mean 'tp_degree'?" in body["errors"][0]["message"]
    assert builds(env) == 0
