"""Roll-forward campaigns of NxD Inference artifacts through the API, on both ledgers (as tests/web/test_campaigns.py;
no worker, as there): an hf-checkpoint artifact built for 2.28.0 is resubmitted for 2.29.0 with the same model
pin (an S3 prefix's object versions even after the prefix changed; an uploaded archive), its NeuronConfig
validated against 2.29.0's NxD Inference and its key computed with 2.29.0's toolchain; a NeuronConfig field the
new release's NxDI lacks is that item's refusal, the others move."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from compilesvc.ledger.models import Artifact, ArtifactBucket, BucketCompile, Build
from compilesvc.spec.checkpoint import canonical_config
from compilesvc.spec.parsing import parse_spec
from tests.fixtures.checkpoints import Checkpoints, tar_of
from tests.fixtures.s3server import S3Server
from tests.spec.test_keys import needs_nxdi_toolchain
from tests.web.conftest import EnvFactory
from tests.web.support import Env, complete_build

pytestmark = needs_nxdi_toolchain


@pytest.fixture
def ckpt_bucket(s3_server: S3Server) -> str:
    """Where the tests' team keeps its checkpoints: versioned, pinned by version."""
    bucket = s3_server.new_bucket("ckpt")
    s3_server.raw_client().put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    return bucket


@pytest.fixture
def s3_env(make_env: EnvFactory, ledger_url: str, s3_server: S3Server, ckpt_bucket: str,
           monkeypatch: pytest.MonkeyPatch) -> Env:
    s3_server.use_as_credential_chain(monkeypatch)
    # The client's admin token is of team "web-tests" (its owner): its checkpoints' bucket is its model source.
    return make_env(ledger_url, s3_endpoint_url=s3_server.endpoint_url, s3_region=s3_server.region,
                    model_s3_prefixes={"web-tests": [f"s3://{ckpt_bucket}/"]})


def put_prefix(s3: S3Server, directory: Path, bucket: str) -> tuple[str, str, dict[str, str]]:
    raw = s3.raw_client()
    prefix = f"llama-{uuid.uuid4().hex[:8]}/"
    versions = {path.name: raw.put_object(Bucket=bucket, Key=prefix + path.name, Body=path.read_bytes())["VersionId"]
                for path in sorted(directory.iterdir()) if path.is_file()}
    return bucket, prefix, versions


def llm_doc(uri: str, sdk: str, name: str, **neuron_config: Any) -> dict[str, Any]:
    return {"model": {"uri": uri, "format": "hf-checkpoint", "name": name}, "target": "trn2", "sdk": sdk,
            "neuron_config": {"tp_degree": 8, "seq_len": 128, **neuron_config}, "labels": {"fleet": "llm"}}


def publish(env: Env, document: dict[str, Any]) -> dict[str, Any]:
    response = env.submit(document)
    assert response.status_code == 202, response.get_data(as_text=True)
    complete_build(env.services, response.json["build_id"])
    return dict(response.json)


def rollforward(env: Env, from_sdk: str, to_sdk: str, **body: Any) -> Any:
    response = env.client.post("/v1/campaigns/rollforward", json={"from_sdk": from_sdk, "to_sdk": to_sdk,
                                                                  "queue_anyway": True, **body})
    assert response.status_code in (200, 201), response.get_data(as_text=True)
    return response.json


def model_pin(env: Env, artifact_key: str) -> dict[str, Any]:
    with env.services.sessions() as session:
        return dict(session.scalars(
            select(BucketCompile.model).join(ArtifactBucket, ArtifactBucket.bucket_compile_id == BucketCompile.id)
            .join(Artifact, Artifact.id == ArtifactBucket.artifact_id).where(Artifact.key == artifact_key)).one())


def material(env: Env, artifact_key: str) -> dict[str, Any]:
    with env.services.sessions() as session:
        return dict(session.scalars(select(Artifact.material).where(Artifact.key == artifact_key)).one())


def test_an_nxdi_artifact_rolls_from_2_28_to_2_29_with_its_pins(s3_env: Env, s3_server: S3Server, ckpt_bucket: str,
                                                                 tiny_checkpoints: Checkpoints) -> None:
    env = s3_env
    bucket, prefix, versions = put_prefix(s3_server, tiny_checkpoints.base, ckpt_bucket)
    from_prefix = publish(env, llm_doc(f"s3://{bucket}/{prefix}", "2.28.0", "llama-s3", batch_size=1))
    from_blob = publish(env, llm_doc(env.upload(tar_of(tiny_checkpoints.sharded)), "2.28.0", "llama-blob",
                                     batch_size=2))
    source_pin = model_pin(env, from_prefix["artifact_key"])
    assert {o["path"]: o["version_id"] for o in source_pin["fetch"]["objects"]} == versions

    # The prefix changes after the build: a resubmit of its URI would pin the new config.json (another key).
    s3_server.raw_client().put_object(Bucket=bucket, Key=prefix + "config.json",
                                      Body=(tiny_checkpoints.deeper / "config.json").read_bytes())

    plan = rollforward(env, "2.28.0", "2.29.0", dry_run=True)
    campaign = rollforward(env, "2.28.0", "2.29.0")
    assert campaign["progress"]["total"] == 2 and campaign["progress"]["refused"] == 0, json.dumps(campaign)
    assert campaign["progress"]["building"] == 2
    by_source = {item["source_key"]: item for item in campaign["items"]}
    assert {i["source_key"]: i["key"] for i in plan["items"]} == {
        k: i["artifact_key"] for k, i in by_source.items()}  # the dry run keyed them with the same pins

    for source, name in ((from_prefix, "llama-s3"), (from_blob, "llama-blob")):
        item = by_source[source["artifact_key"]]
        new_key = item["artifact_key"]
        assert new_key != source["artifact_key"]
        with env.services.sessions() as session:
            build = session.get_one(Build, item["build_id"])
            assert build.sdk == "2.29.0" and build.model_name == name
        old_pin, new_pin = model_pin(env, source["artifact_key"]), model_pin(env, new_key)
        assert new_pin == {**old_pin, "uri": old_pin["uri"]}  # the same objects, versions and sha256
        # The key: 2.29.0's NxDI and toolchain, the NeuronConfig canonical for 2.29.0 (its new field filled in).
        old, new = material(env, source["artifact_key"]), material(env, new_key)
        assert old["toolchain"]["neuron"] != new["toolchain"]["neuron"]
        assert new["neuron_config"] == parse_spec(build_spec(env, item["build_id"])).nxdi_config
        assert "enable_ve_data_parallel" in new["neuron_config"]
        assert "enable_ve_data_parallel" not in old["neuron_config"]
        assert new["model"] == old["model"] and new["model"]["config"] == canonical_config(Checkpoints.config(
            tiny_checkpoints.base if name == "llama-s3" else tiny_checkpoints.sharded), dtype_alias=True)
    # What the prefix holds now would have been another key: the campaign did not read it.
    fresh = env.submit(llm_doc(f"s3://{bucket}/{prefix}", "2.29.0", "llama-s3", batch_size=1))
    assert fresh.status_code == 202 and fresh.json["artifact_key"] != by_source[from_prefix["artifact_key"]][
        "artifact_key"]

    for item in campaign["items"]:
        complete_build(env.services, item["build_id"])
    done = env.client.get(f"/v1/campaigns/{campaign['id']}").json
    assert done["state"] == "finished" and done["progress"]["built"] == 2


def build_spec(env: Env, build_id: int) -> dict[str, Any]:
    return dict(env.client.get(f"/v1/builds/{build_id}").json["spec"])


def test_a_neuron_config_field_the_new_release_lacks_is_that_items_refusal(
        env: Env, tiny_checkpoints: Checkpoints) -> None:
    """2.29.0's NxDI has ``enable_ve_data_parallel`` and 2.28.0's does not (compilesvc/spec/nxdi_fields.json): a
    campaign from 2.29.0 to 2.28.0 refuses the artifact using it, naming the field, and moves the other."""
    uri = env.upload(tar_of(tiny_checkpoints.base))
    using = publish(env, llm_doc(uri, "2.29.0", "llama-ve", enable_ve_data_parallel=False))
    plain = publish(env, llm_doc(uri, "2.29.0", "llama", batch_size=2))
    plan = rollforward(env, "2.29.0", "2.28.0", dry_run=True)
    campaign = rollforward(env, "2.29.0", "2.28.0")
    progress = campaign["progress"]
    assert (progress["total"], progress["refused"], progress["building"]) == (2, 1, 1), json.dumps(campaign)
    (refusal,) = campaign["refusals"]
    assert refusal["source_key"] == using["artifact_key"]
    assert "neuron_config.enable_ve_data_parallel" in refusal["refusal"], refusal["refusal"]
    planned = {i["source_key"]: i for i in plan["items"]}
    assert planned[using["artifact_key"]]["refusal"] == refusal["refusal"]
    moved = next(i for i in campaign["items"] if i["source_key"] == plain["artifact_key"])
    assert moved["build_id"] is not None and moved["artifact_key"] == planned[plain["artifact_key"]]["key"]
