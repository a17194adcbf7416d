"""An LLM artifact end to end on Postgres + Redis + S3 (issue 29's "Done when"): real ``compilesvc serve``,
``relay`` and ``worker`` processes, a weed S3 server holding both the artifact store and a versioned bucket of
checkpoints, the tiny Llama checkpoints ``transformers`` saves (tests/fixtures/checkpoints.py), and the NxD
Inference TEST DOUBLE (tests/doubles/neuron/neuronx_distributed_inference) on the worker's path. Everything a user
does goes through the ``compilesvc`` command line, as a CI job and a fleet host run it (docs/llm.md):

- a checkpoint under an S3 prefix (pinned object by object at submit) and one uploaded as a tar archive;
- ``compilesvc submit`` → the published NxDI directory (model.pt, neuron_config.json, weights/tp{rank}_… when
  pre-sharding), a sha256 per file; a fine-tune is a hit, a config change a miss explained in one line;
- ``compilesvc fetch --spec`` and, with the API and everything else stopped, ``fetch --offline`` and
  ``serve-env --offline`` with matching vLLM arguments (0) and mismatched ones (4, one ``error:`` line each);
- the build page shows the NeuronConfig and the artifact's files;
- a bad neuron_config and an architecture NxDI does not have are exit 2 naming them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.doubles import neuron_double_env
from tests.fixtures.checkpoints import Checkpoints, sha256_file, tar_of
from tests.fixtures.ports import free_port
from tests.fixtures.s3server import S3Server
from tests.fixtures.signing import trust_env
from tests.fixtures.tokens import BOOTSTRAP_TOKEN
from tests.workers.conftest import COMPILESVC, Cluster

MakeCluster = Callable[..., Cluster]
SDK = "2.29.0"  # a release the double ships NxDI for (0.9.17334)
#: The worker's view of the SDK: the double's packages at SDK's versions, no Neuron device.
WORKER_VARIABLES = ("PYTHONPATH", "PATH", "COMPILESVC_NEURON_SDK", "COMPILESVC_NEURON_DOUBLE_RELEASE",
                    "COMPILESVC_NEURON_DOUBLE_DEVICES")
#: vLLM drives a batch through continuous batching only (compilesvc.fleet check_loadable cites its lines).
NEURON_CONFIG = {"tp_degree": 2, "batch_size": 2, "seq_len": 256, "torch_dtype": "bfloat16",
                 "buckets": [64, 128, 256], "is_continuous_batching": True}
#: vLLM's arguments that match NEURON_CONFIG.
MATCHING = ["--tensor-parallel-size", "2", "--max-num-seqs", "2", "--max-model-len", "256", "--dtype", "bfloat16"]


def spec_of(uri: str, name: str = "tiny-llama", target: str = "trn2", **neuron_config: Any) -> dict[str, Any]:
    return {"model": {"uri": uri, "format": "hf-checkpoint", "name": name}, "target": target, "sdk": SDK,
            "neuron_config": {**NEURON_CONFIG, **neuron_config}, "labels": {"pipeline": "llm-e2e"}}


def put_prefix(s3: S3Server, bucket: str, prefix: str, directory: Path) -> None:
    raw = s3.raw_client()
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            raw.put_object(Bucket=bucket, Key=prefix + path.relative_to(directory).as_posix(), Body=path.read_bytes())


class Cli:
    """The ``compilesvc`` command as a CI job or a fleet host runs it: the API's URL and token, the service's
    signing key trusted, its own artifact cache."""

    def __init__(self, env: dict[str, str], cwd: Path):
        self.env, self.cwd = env, cwd

    def __call__(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([COMPILESVC, *args], env=self.env, cwd=self.cwd, capture_output=True, text=True,
                              timeout=timeout)

    def spec(self, name: str, document: dict[str, Any]) -> str:
        (self.cwd / name).write_text(json.dumps(document, indent=1))  # JSON is YAML
        return name

    def submit(self, name: str, *args: str) -> subprocess.CompletedProcess[str]:
        return self("submit", name, "--poll", "0.3", *args)


def ui_page(base: str, path: str) -> str:
    """``path`` as a person's browser gets it: logged in through the login form with the admin token."""
    browser = requests.Session()
    form = browser.get(f"{base}/login", timeout=30)
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', form.text)
    assert form.status_code == 200 and csrf is not None, form.text[:500]
    logged_in = browser.post(f"{base}/login", data={"csrf_token": csrf.group(1), "next": path,
                                                    "token": BOOTSTRAP_TOKEN}, timeout=30)
    assert logged_in.status_code == 200 and logged_in.url == f"{base}{path}", (logged_in.status_code, logged_in.url)
    return logged_in.text


def text_of(html: str) -> str:
    return " ".join(re.sub(r"<[^>]+>", " ", html).split())


def test_an_llm_checkpoint_compiles_through_the_service_and_boots_a_fleet_offline(
        make_cluster: MakeCluster, s3_server: S3Server, tiny_checkpoints: Checkpoints, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)  # the in-process services (the test's reads) talk to the same S3
    models = s3_server.new_bucket("ckpt")  # where a team keeps its checkpoints: versioned, pinned by version
    s3_server.raw_client().put_bucket_versioning(Bucket=models, VersioningConfiguration={"Status": "Enabled"})
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cluster = make_cluster(store_url=f"s3://{s3_server.new_bucket('llm')}/artifacts", extra_env=s3_server.env(),
                           s3_endpoint_url=s3_server.endpoint_url, public_url=base, lease_seconds=30,
                           heartbeat_seconds=1,
                           model_s3_prefixes={"bootstrap": [f"s3://{models}/"]})  # the CI's token's team
    worker_env = neuron_double_env({"PYTHONPATH": os.environ.get("PYTHONPATH", ""), "PATH": os.environ["PATH"]},
                                   sdk=SDK, devices=0)
    # A compile that takes a moment (an 8B model's takes 15 minutes), logging while it runs: the knob is the
    # double's own (COMPILESVC_NEURON_DOUBLE_*), so it reaches the compile child through the worker's allow-list.
    cluster.start_worker("w1", concurrency=2, env={**{k: worker_env[k] for k in WORKER_VARIABLES},
                                                   "COMPILESVC_NEURON_DOUBLE_NXDI_SECONDS": "0.3"})
    cluster.start_relay()
    cluster.start_api(port, workers=2)
    work = tmp_path / "ci"
    work.mkdir()
    cli = Cli({**cluster.client_env(port, tmp_path), **trust_env(cluster.services),
               "COMPILESVC_CACHE_DIR": str(tmp_path / "cache")}, work)
    api = requests.Session()
    api.headers["Authorization"] = f"Bearer {BOOTSTRAP_TOKEN}"

    # 1. The base checkpoint under an S3 prefix, compiled through the CLI as CI would.
    prefix = f"tiny-llama-{uuid.uuid4().hex[:8]}/"
    put_prefix(s3_server, models, prefix, tiny_checkpoints.base)
    base_uri = f"s3://{models}/{prefix}"
    built = cli.submit(cli.spec("llama.yaml", spec_of(base_uri)), "--json")
    assert built.returncode == 0, built.stderr
    first = json.loads(built.stdout)
    key = first["key"]
    assert first["outcome"] == "new" and re.fullmatch(r"[0-9a-f]{64}", key)
    again = cli.submit("llama.yaml")  # the plain form a CI step captures: the key alone on stdout
    assert again.returncode == 0 and again.stdout == f"{key}\n", again.stderr

    logged = api.get(f"{base}/v1/builds/{first['build_id']}/logs", params={"after": 0, "limit": 5000},
                     timeout=30).json()["lines"]
    assert any("TEST DOUBLE: compiling" in line["line"] for line in logged), [line["line"] for line in logged][-20:]

    # 2. The published artifact is NxDI's compiled directory, every file with its sha256.
    manifest = api.get(f"{base}/v1/artifacts/{key}", timeout=30).json()
    [bucket] = manifest["buckets"]
    files = {f["path"]: f for f in bucket["files"]}
    assert {path: f["role"] for path, f in files.items()} == {"model.pt": "model", "neuron_config.json": "aux"}
    for entry in files.values():
        body = requests.get(entry["url"], timeout=30).content
        assert (len(body), hashlib.sha256(body).hexdigest()) == (entry["size"], entry["sha256"])
    compiled = json.loads(requests.get(files["neuron_config.json"]["url"], timeout=30).content)
    assert {k: compiled["neuron_config"][k] for k in ("tp_degree", "batch_size", "seq_len", "torch_dtype",
                                                      "context_encoding_buckets", "save_sharded_checkpoint")} == {
        "tp_degree": 2, "batch_size": 2, "seq_len": 256, "torch_dtype": "bfloat16",
        "context_encoding_buckets": [64, 128, 256], "save_sharded_checkpoint": False}

    # 3. A fine-tune (same config.json, other weights), uploaded as the tar archive an hf-checkpoint blob is: the
    # compiled model.pt holds no weights, so it is a hit on the same key, and nothing compiles again.
    archive = tmp_path / "fine-tune.tar"
    archive.write_bytes(tar_of(tiny_checkpoints.fine_tune, top="fine-tune"))
    uploaded = cli("upload", str(archive))
    assert uploaded.returncode == 0, uploaded.stderr
    tuned_uri = uploaded.stdout.strip()
    assert tuned_uri == f"blob:sha256:{sha256_file(archive)}"
    tuned = cli.submit(cli.spec("tuned.yaml", spec_of(tuned_uri)), "--json")
    assert tuned.returncode == 0, tuned.stderr
    hit = json.loads(tuned.stdout)
    assert (hit["outcome"], hit["key"]) == ("hit", key)
    assert [(b["origin"]["how"], b["origin"]["from_build"]) for b in hit["buckets"]] == [("reused", first["build_id"])]
    [compile_] = api.get(f"{base}/v1/builds/{first['build_id']}", timeout=30).json()["buckets"]
    assert cluster.bucket(compile_["key"]).attempts == 1

    # 4. A config change is a miss, explained in one line naming the field.
    longer = cli.submit(cli.spec("longer.yaml", spec_of(base_uri, seq_len=512)), "--json")
    assert longer.returncode == 0, longer.stderr
    miss = json.loads(longer.stdout)
    assert miss["outcome"] == "new" and miss["key"] != key
    explained = api.get(f"{base}/v1/builds/{miss['build_id']}/miss", timeout=30).json()
    lines = [c["text"] for c in explained["changes"]]
    assert explained["compared_with"]["artifact_key"] == key
    assert lines[0] == "neuron_config.seq_len 256 → 512", lines  # the edit, alone; what NxDI derives follows
    assert lines[1:] == ["neuron_config fields NxDI derives from these changed with them: max_context_length "
                         "256 → 512, max_length 256 → 512, n_active_tokens 256 → 512, n_positions 256 → 512, "
                         "pa_block_size 256 → 512"], lines

    # The CI job's other target (docs/llm.md compiles for trn2 and trn3: NxDI of SDK 2.29 runs on Trn2 and newer
    # only, release-notes/components/nxd-inference.rst:61 at aws-neuron-sdk@81ce03ae): its own key and compile.
    trn3 = cli.submit(cli.spec("trn3.yaml", spec_of(base_uri, target="trn3")), "--json")
    assert trn3.returncode == 0, trn3.stderr
    trn3_key = json.loads(trn3.stdout)["key"]
    assert trn3_key not in (key, miss["key"])
    trn3_miss = [c["text"] for c in api.get(f"{base}/v1/builds/{json.loads(trn3.stdout)['build_id']}/miss",
                                            timeout=30).json()["changes"]]
    assert "target trn2 → trn3" in trn3_miss, trn3_miss

    # Pre-sharded weights: NxDI writes one safetensors file per rank, and the weights are in the key.
    sharded = cli.submit(cli.spec("sharded.yaml", spec_of(base_uri, save_sharded_checkpoint=True)), "--json")
    assert sharded.returncode == 0, sharded.stderr
    sharded_key = json.loads(sharded.stdout)["key"]
    sharded_files = {f["path"]: f for f in api.get(f"{base}/v1/artifacts/{sharded_key}", timeout=30).json()[
        "buckets"][0]["files"]}
    assert {p: f["role"] for p, f in sharded_files.items()} == {
        "model.pt": "model", "neuron_config.json": "aux",
        "weights/tp0_sharded_checkpoint.safetensors": "weights-shard",
        "weights/tp1_sharded_checkpoint.safetensors": "weights-shard"}
    assert all(re.fullmatch(r"[0-9a-f]{64}", f["sha256"]) for f in sharded_files.values())
    tuned_sharded = cli.submit(cli.spec("tuned-sharded.yaml", spec_of(tuned_uri, save_sharded_checkpoint=True)),
                               "--json", "--no-wait")
    assert tuned_sharded.returncode == 0, tuned_sharded.stderr
    assert json.loads(tuned_sharded.stdout)["outcome"] == "new"  # other weights, other shards: another key

    # Bad input, through the CLI: exit 2 and the field named.
    misspelt = cli.submit(cli.spec("misspelt.yaml", spec_of(base_uri, tp_degre=2)))
    assert misspelt.returncode == 2 and misspelt.stdout == "", misspelt.stderr
    assert "neuron_config.tp_degre" in misspelt.stderr and "tp_degree" in misspelt.stderr, misspelt.stderr
    too_long = cli.submit(cli.spec("too-long.yaml", spec_of(base_uri, buckets=[64, 512])))
    assert too_long.returncode == 2 and "neuron_config.buckets" in too_long.stderr, too_long.stderr
    other = tmp_path / "gpt2"
    shutil.copytree(tiny_checkpoints.base, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    put_prefix(s3_server, models, f"gpt2-{prefix}", other)
    unsupported = cli.submit(cli.spec("gpt2.yaml", spec_of(f"s3://{models}/gpt2-{prefix}")))
    assert unsupported.returncode == 2 and unsupported.stdout == "", unsupported.stderr
    assert "GPT2LMHeadModel" in unsupported.stderr and "model.uri" in unsupported.stderr, unsupported.stderr

    # 5. The build page: the NeuronConfig the compile used and the artifact's files.
    page = text_of(ui_page(base, f"/builds/{first['build_id']}"))
    assert "NeuronConfig" in page and "tp_degree 2 the spec" in page and "seq_len 256 the spec" in page
    assert "save_sharded_checkpoint false default" in page
    for path, entry in files.items():
        assert f"{path} " in page and entry["sha256"] in page
    assert "neuron_config.seq_len 256 → 512" in text_of(ui_page(base, f"/builds/{miss['build_id']}"))

    # 6. A fleet host: fetch while the API is up, then everything stops and it boots offline.
    fetched = cli("fetch", "--spec", "llama.yaml", "--json")
    assert fetched.returncode == 0, fetched.stderr
    assert json.loads(fetched.stdout)["key"] == key
    assert cli("fetch", "--spec", "sharded.yaml", "-q").returncode == 0
    for process in cluster.processes:
        process.stop()
    cache = tmp_path / "cache" / "v1" / "artifacts"
    offline = cli("fetch", "--spec", "llama.yaml", "--offline")
    assert offline.returncode == 0, offline.stderr
    assert offline.stdout.strip() == str(cache / key)
    assert "all from the cache (no network)" in offline.stderr

    # The pre-sharded artifact is served from its compiled directory itself.
    served = cli("serve-env", "--spec", "sharded.yaml", "--offline", "-q", "--", "--model", "/models/llama", *MATCHING)
    assert served.returncode == 0, served.stderr
    assert f"export NEURON_COMPILED_ARTIFACTS={cache / sharded_key / 'bucket-0'}" in served.stdout.splitlines()
    # The weight-free one is served from a directory of links: the compiled files and the checkpoint's weights.
    checkpoint = tmp_path / "models" / "tiny-llama"
    shutil.copytree(tiny_checkpoints.fine_tune, checkpoint)
    serving = tmp_path / "run" / "llama"
    boot = ["serve-env", "--spec", "llama.yaml", "--offline", "-q", "--checkpoint", str(checkpoint),
            "--serving-dir", str(serving), "--", "--model", str(checkpoint)]
    ok = cli(*boot, *MATCHING)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[0] == f"export NEURON_COMPILED_ARTIFACTS={serving}"
    assert os.readlink(serving / "model.pt") == str(cache / key / "bucket-0" / "model.pt")
    assert os.readlink(serving / "model.safetensors") == str(checkpoint / "model.safetensors")
    for mismatch, says in (
            (["--tensor-parallel-size", "4"], "error: --tensor-parallel-size 4 but the artifact was compiled for "
                                              "tp_degree 2"),
            (["--max-num-seqs", "8"], "error: --max-num-seqs 8 but the artifact was compiled for batch_size 2"),
            (["--max-model-len", "1024"], "error: --max-model-len 1024 but the artifact was compiled for seq_len 256")):
        refused = cli(*boot, *MATCHING, *mismatch)  # the later value wins, as in vLLM's argparse
        assert refused.returncode == 4 and refused.stdout == "", refused.stderr
        [line] = refused.stderr.splitlines()
        assert line.startswith(says), line
    every = cli(*boot, "--dtype", "bfloat16", "--tensor-parallel-size", "4", "--max-num-seqs", "8",
                "--max-model-len", "1024")
    assert every.returncode == 4 and len(every.stderr.splitlines()) == 3, every.stderr
    assert all(line.startswith("error: ") for line in every.stderr.splitlines())
