"""``compilesvc serve-env`` on a published NxD Inference artifact (the real API, ledger, store and signing; the
compiled directory's files as NxDI writes them), run as a fleet host runs it: online, then offline after the
API has stopped; its output evaluated by a real shell and fed back as vLLM's arguments."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from compilesvc.fleet import ArtifactSet, NotAnLLMArtifact, NotCached, check_serving, parse_vllm_args
from tests.fleet.conftest import FleetApi
from tests.fleet.nxdi_files import compiled_files, inference_config, write_checkpoint
from tests.web.support import complete_build, spec_for

#: A one-core artifact: model.pt, neuron_config.json, weights/tp0_sharded_checkpoint.safetensors.
PRESHARDED = {"tp_degree": 1, "batch_size": 2, "seq_len": 1024, "save_sharded_checkpoint": True}
MATCHING = ["--tensor-parallel-size", "1", "--max-num-seqs", "2", "--max-model-len", "1024", "--dtype", "bfloat16"]


def publish_llm(api: FleetApi, *, shards: int = 1, **neuron: object) -> str:
    document = inference_config(**{**PRESHARDED, **neuron})
    return api.publish(buckets=((1, 8),), files=lambda _key: compiled_files(document, shards=shards))


def serve_env(api: FleetApi, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "compilesvc", "serve-env", *args], capture_output=True, text=True,
                          timeout=120, env=api.environ())


def test_a_fleet_host_gets_the_vllm_environment_and_keeps_it_with_the_api_gone(fleet_api: FleetApi) -> None:
    key = publish_llm(fleet_api)
    bucket = fleet_api.cache / "v1" / "artifacts" / key / "bucket-0"
    first = serve_env(fleet_api, key, "-q")
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines() == [
        f"export NEURON_COMPILED_ARTIFACTS={bucket}",
        "export VLLM_NEURON_FRAMEWORK=neuronx-distributed-inference",
        "VLLM_SERVE_ARGS='--tensor-parallel-size 1 --max-num-seqs 2 --max-model-len 1024 --dtype bfloat16'"]
    assert sorted(p.relative_to(bucket).as_posix() for p in bucket.rglob("*") if p.is_file()) == [
        "model.pt", "neuron_config.json", "weights/tp0_sharded_checkpoint.safetensors"]
    fleet_api.stop()

    again = serve_env(fleet_api, key, "--offline", "-q")
    assert again.returncode == 0 and again.stdout == first.stdout, again.stderr
    # What a boot script does with it: eval, then hand vLLM the arguments, which the check accepts.
    script = (f'eval "$({sys.executable} -m compilesvc serve-env {key} --offline -q)" && '
              f'echo "$NEURON_COMPILED_ARTIFACTS" && {sys.executable} -m compilesvc serve-env {key} --offline -- '
              "serve /models/llama $VLLM_SERVE_ARGS")
    booted = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=120, env=fleet_api.environ())
    assert booted.returncode == 0, booted.stderr
    assert booted.stdout.splitlines()[0] == str(bucket)
    assert booted.stderr.strip() == f"{key}: the vLLM arguments match the artifact"

    document = json.loads(serve_env(fleet_api, key, "--offline", "--format", "json").stdout)
    assert document["directory"] == str(bucket) and document["weights"] == "pre-sharded"
    assert document["environment"]["NEURON_COMPILED_ARTIFACTS"] == str(bucket)
    assert document["neuron_config"]["tp_degree"] == 1 and document["vllm_args"] == MATCHING


def test_mismatched_vllm_arguments_are_refused_one_line_each(fleet_api: FleetApi) -> None:
    key = publish_llm(fleet_api)
    assert serve_env(fleet_api, key, "-q").returncode == 0
    fleet_api.stop()
    one = serve_env(fleet_api, key, "--offline", "--", "--tensor-parallel-size", "4", *MATCHING[2:])
    assert one.returncode == 4 and one.stdout == ""
    assert one.stderr == "error: --tensor-parallel-size 4 but the artifact was compiled for tp_degree 1\n"
    many = serve_env(fleet_api, key, "--offline", "--", "--model", "/m", "-tp", "1", "--max-num-seqs", "8",
                     "--max-model-len", "4096", "--dtype", "float16")
    assert many.returncode == 4
    assert many.stderr.splitlines() == [
        "error: --max-num-seqs 8 but the artifact was compiled for batch_size 2 (sequence ids beyond the compiled KV "
        "cache rows)",
        "error: --max-model-len 4096 but the artifact was compiled for seq_len 1024",
        "error: --dtype float16 but the artifact was compiled for torch_dtype bfloat16"]
    unreadable = serve_env(fleet_api, key, "--offline", "--", "--max-model-len", "lots")
    assert unreadable.returncode == 2
    assert unreadable.stderr == "error: vLLM arguments: --max-model-len 'lots' is not a whole number\n"
    negative = serve_env(fleet_api, key, "--offline", "--", "--max-num-seqs", "-1")
    assert negative.returncode == 2
    assert negative.stderr == "error: vLLM arguments: --max-num-seqs '-1' must be at least 1\n"


@pytest.fixture
def weight_free(fleet_api: FleetApi) -> str:
    key = publish_llm(fleet_api, shards=0, save_sharded_checkpoint=False)
    result = serve_env(fleet_api, key, "--format", "json")  # fetched into the cache, then refused: no weights
    assert result.returncode == 4, result.stderr
    fleet_api.stop()
    return key


def test_the_checkpoint_is_linked_where_nxdi_reads_it(fleet_api: FleetApi, weight_free: str, tmp_path: Path) -> None:
    key = weight_free
    bucket = fleet_api.cache / "v1" / "artifacts" / key / "bucket-0"
    refused = serve_env(fleet_api, key, "--offline", "--", *MATCHING, "--model", str(tmp_path))
    assert refused.returncode == 4
    assert refused.stderr == (
        "error: the artifact holds no weights (save_sharded_checkpoint false) and its _name_or_path "
        f"/tmp/compilesvc-work/checkpoint does not exist on this host: NxDI would look for them in {bucket}, fail, "
        "and vLLM would compile on this host; give serve-env --checkpoint CKPT --serving-dir DIR (docs/fleet.md)\n")

    checkpoint = write_checkpoint(tmp_path / "llama")
    serving = tmp_path / "srv" / "llama"
    ok = serve_env(fleet_api, key, "--offline", "-q", "--checkpoint", str(checkpoint), "--serving-dir", str(serving),
                   "--", *MATCHING, "--model", str(checkpoint))
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[0] == f"export NEURON_COMPILED_ARTIFACTS={serving}"
    assert os.readlink(serving / "model.pt") == str(bucket / "model.pt")
    assert os.readlink(serving / "model.safetensors") == str(checkpoint / "model.safetensors")
    assert (serving / "neuron_config.json").read_bytes() == (bucket / "neuron_config.json").read_bytes()

    other = write_checkpoint(tmp_path / "other")
    wrong = serve_env(fleet_api, key, "--offline", "--checkpoint", str(checkpoint), "--serving-dir", str(serving),
                      "--", *MATCHING, "--model", str(other))
    assert wrong.returncode == 4
    assert wrong.stderr == f"error: --model {other} but NxDI will load the weights from {checkpoint}\n"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes").write_text("x")
    taken = serve_env(fleet_api, key, "--offline", "--checkpoint", str(checkpoint), "--serving-dir", str(mine))
    assert taken.returncode == 2 and "not empty and not an earlier serving directory" in taken.stderr
    alone = serve_env(fleet_api, key, "--offline", "--checkpoint", str(checkpoint))
    assert alone.returncode == 2 and alone.stderr == "error: --checkpoint and --serving-dir go together\n"


def test_the_spec_names_the_artifact_offline_too(fleet_api: FleetApi, tmp_path: Path) -> None:
    key = publish_llm(fleet_api)
    spec_file = tmp_path / "llm.json"
    spec_file.write_text(json.dumps(spec_for(fleet_api.env.upload(b"m"), buckets=((1, 8),))))
    online = serve_env(fleet_api, "--spec", str(spec_file), "-q", "--", *MATCHING)
    assert online.returncode == 0, online.stderr
    fleet_api.stop()
    offline = serve_env(fleet_api, "--spec", str(spec_file), "--offline", "-q", "--", *MATCHING)
    assert offline.returncode == 0 and offline.stdout == online.stdout, offline.stderr
    assert f"/v1/artifacts/{key}/bucket-0" in offline.stdout


def test_other_artifacts_and_bad_command_lines_are_refused(fleet_api: FleetApi) -> None:
    shapes = fleet_api.publish()  # a trace compile: two shape buckets, no neuron_config.json
    result = serve_env(fleet_api, shapes)
    assert result.returncode == 2
    assert result.stderr == (f"error: {shapes} is not an NxD Inference artifact: it has 2 buckets, an LLM compile "
                             "has one\n")
    single = fleet_api.publish(buckets=((4, 8),))
    result = serve_env(fleet_api, single)
    assert result.returncode == 2 and "has no neuron_config.json (files: model.pt)" in result.stderr
    for args, message in ((("nothex",), "'nothex' is not an artifact key"), ((), "give an artifact KEY or --spec")):
        bad = serve_env(fleet_api, *args)
        assert bad.returncode == 2 and message in bad.stderr and bad.stderr.count("\n") == 1, bad.stderr


def llm_spec(api: FleetApi, tmp_path: Path) -> Path:
    """An hf-checkpoint spec (the checkpoint uploaded as the tar archive the spec takes) in a file."""
    checkpoint = write_checkpoint(tmp_path / "llama")
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w") as tar:
        tar.add(checkpoint, arcname="llama")
    spec = {"model": {"uri": api.env.upload(archive.getvalue()), "format": "hf-checkpoint", "name": "llama"},
            "target": "inf2", "sdk": "2.28.0",  # NxDI on inf2: SDK <= 2.28 (2.29 notes: Trn2 and newer)
            "neuron_config": {"tp_degree": 1, "batch_size": 2, "seq_len": 1024, "save_sharded_checkpoint": True}}
    path = tmp_path / "llm.json"
    path.write_text(json.dumps(spec))
    return path


def test_an_hf_checkpoint_spec_is_a_spec_the_client_takes(fleet_api: FleetApi, tmp_path: Path) -> None:
    spec = llm_spec(fleet_api, tmp_path)
    for command in ("fetch", "serve-env"):
        # Offline and never fetched: the spec validated on the client (a bad one is exit 2), then the cache said no.
        result = subprocess.run([sys.executable, "-m", "compilesvc", command, "--spec", str(spec), "--offline"],
                                capture_output=True, text=True, timeout=120, env=fleet_api.environ())
        assert result.returncode == 1, result.stderr
        assert result.stderr.startswith("error: offline, and this spec was never fetched into "), result.stderr


def test_fetch_and_serve_env_of_an_hf_checkpoint_spec(fleet_api: FleetApi, tmp_path: Path) -> None:
    spec = llm_spec(fleet_api, tmp_path)
    response = fleet_api.env.submit(json.loads(spec.read_text()))
    assert response.status_code == 202, response.get_data(as_text=True)
    key = response.json["artifact_key"]
    document = inference_config(**PRESHARDED)
    complete_build(fleet_api.env.services, response.json["build_id"],
                   files=lambda _key: compiled_files(document, shards=1))
    fetched = fleet_api.fetch_json("--spec", str(spec))
    assert fetched["key"] == key and fetched["files"] == 3
    fleet_api.stop()
    served = serve_env(fleet_api, "--spec", str(spec), "--offline", "-q", "--", *MATCHING)
    assert served.returncode == 0, served.stderr
    assert f"export NEURON_COMPILED_ARTIFACTS={fetched['directory']}/bucket-0" in served.stdout


def test_the_library_opens_an_llm_artifact_as_its_compiled_directory(fleet_api: FleetApi, tmp_path: Path) -> None:
    key = publish_llm(fleet_api)
    shapes = fleet_api.publish()
    cache = tmp_path / "lib-cache"
    ArtifactSet.open(key, cache_dir=cache, api_url=fleet_api.base, token=fleet_api.token)
    fleet_api.stop()
    artifacts = ArtifactSet.open(key, cache_dir=cache, offline=True)
    bucket = cache / "v1" / "artifacts" / key / "bucket-0"
    assert artifacts.compiled_model_path == bucket == artifacts.llm.directory
    assert artifacts.llm.neuron_config["tp_degree"] == 1 and artifacts.llm.presharded
    assert artifacts.llm.files == ("model.pt", "neuron_config.json", "weights/tp0_sharded_checkpoint.safetensors")
    assert check_serving(artifacts.llm, parse_vllm_args(MATCHING)) == []
    with pytest.raises(NotCached):
        ArtifactSet.open(shapes, cache_dir=cache, offline=True)


def test_a_shape_artifact_is_not_an_llm_artifact(fleet_api: FleetApi, tmp_path: Path) -> None:
    shapes = fleet_api.publish()
    artifacts = ArtifactSet.open(shapes, cache_dir=tmp_path / "lib-cache", api_url=fleet_api.base,
                                 token=fleet_api.token)
    with pytest.raises(NotAnLLMArtifact, match="it has 2 buckets, an LLM compile has one"):
        _ = artifacts.compiled_model_path


def test_check_host_refuses_an_artifact_built_for_other_neuron_packages(fleet_api: FleetApi) -> None:
    document = inference_config(**PRESHARDED)
    key = fleet_api.publish(buckets=((1, 8),), files=lambda _key: compiled_files(document, shards=1),
                            versions={"torch_neuronx": "2.9.0.2.11.19912", "aws_neuronx_runtime_lib": "2.29.40.0"})
    refused = serve_env(fleet_api, key, "--check-host", "-q")
    assert refused.returncode == 1 and "torch-neuronx: built with 2.9.0.2.11.19912" in refused.stderr
    assert serve_env(fleet_api, key, "-q").returncode == 0  # off by default, as for fetch
