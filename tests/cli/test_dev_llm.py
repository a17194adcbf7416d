"""An LLM on the embedded default, end to end: ``compilesvc dev`` (SQLite ledger, local artifact directory, kombu's
filesystem broker, real API/worker/relay processes) compiles a tiny Llama checkpoint (real ``transformers``, random
weights) through the NxD Inference TEST DOUBLE, the one stand-in here; then a fleet host fetches the artifact by its
spec, the service is stopped, and it fetches again offline and checks vLLM's arguments against the artifact.

How the embedded worker gets Neuron: ``compilesvc dev`` hands its environment to its worker, so the Neuron
environment it starts in (here the double's ``COMPILESVC_NEURON_SDK``, ``PATH``, ``PYTHONPATH``; on a Neuron host the
SDK's virtual environment) makes that worker serve the release's ``nxdi`` queues beside the cpu ones
(docs/llm.md, "Trying it locally"). ``file://`` checkpoints need ``COMPILESVC_ALLOW_FILE_MODELS``, as anywhere.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from compilesvc.cli.dev import ADMIN_TOKEN_FILE
from compilesvc.config.settings import Settings
from compilesvc.lifecycle.artifacts import read_manifest
from compilesvc.signing.keys import GENERATED_KEY_NAME, TRUSTED_KEYS_ENV, public_key_path
from compilesvc.store import open_store
from tests.doubles import neuron_double_env
from tests.fixtures.checkpoints import Checkpoints, tar_of
from tests.fixtures.docs import doc_block, fill
from tests.fixtures.ports import free_port

pytest.importorskip("transformers")

COMPILESVC = str(Path(sys.executable).with_name("compilesvc"))
SDK = "2.27.1"  # the double's default release; it ships NxDI 0.7
#: One NeuronCore, two sequences (continuous batching: vLLM batches only such artifacts), 128 tokens.
NEURON_CONFIG = {"tp_degree": 1, "batch_size": 2, "is_continuous_batching": True, "seq_len": 128,
                 "torch_dtype": "bfloat16", "buckets": [64, 128]}
MATCHING = ["--tensor-parallel-size", "1", "--max-num-seqs", "2", "--max-model-len", "128", "--dtype", "bfloat16"]


def _clean_environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("COMPILESVC_", "AWS_", "TORCHINDUCTOR_"))}


@dataclass
class Dev:
    """A running ``compilesvc dev`` and the environment of a client (CI job, fleet host) talking to it."""

    proc: subprocess.Popen[str]
    data_dir: Path
    client_env: dict[str, str]
    tmp: Path
    serves: str = ""  # what dev said its worker compiles for

    def run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run([COMPILESVC, *args], env=self.client_env, cwd=self.tmp, capture_output=True, text=True,
                              timeout=timeout)

    def spec(self, name: str, uri: str, **neuron: Any) -> Path:
        path = self.tmp / f"{name}.json"
        path.write_text(json.dumps({"model": {"uri": uri, "format": "hf-checkpoint", "name": "tiny-llama"},
                                    "target": "inf2", "sdk": SDK, "neuron_config": {**NEURON_CONFIG, **neuron}}))
        return path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)


@pytest.fixture
def dev(tmp_path: Path) -> Iterator[Dev]:
    data_dir = tmp_path / "data"
    # What a user on a Neuron host has in their shell: the SDK's environment (here the double's) and the release.
    env = neuron_double_env(_clean_environ(), sdk=SDK, devices=0)
    env.update({"COMPILESVC_ALLOW_FILE_MODELS": "true",
                "COMPILESVC_NEURON_DEVICE_GLOB": str(tmp_path / "no-devices" / "neuron[0-9]*")})
    port = free_port()
    proc = subprocess.Popen([COMPILESVC, "dev", "--port", str(port), "--data-dir", str(data_dir)], env=env,
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    handle = Dev(proc, data_dir, {}, tmp_path)
    try:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("worker compiles for: "):
                handle.serves = line.strip()
                break
        else:
            pytest.fail(f"compilesvc dev did not start (exit {proc.wait()}): {''.join(seen)}")
        # A fleet host: the client only (no Neuron SDK, no double), the dev's token and signing key.
        handle.client_env = {**_clean_environ(), "COMPILESVC_API_URL": f"http://127.0.0.1:{port}",
                             "COMPILESVC_TOKEN": (data_dir / ADMIN_TOKEN_FILE).read_text().strip(),
                             "COMPILESVC_CACHE_DIR": str(tmp_path / "cache"),
                             TRUSTED_KEYS_ENV: str(public_key_path(data_dir / GENERATED_KEY_NAME))}
        yield handle
    finally:
        handle.stop()


def _published_files(data_dir: Path, key: str) -> list[str]:
    manifest = read_manifest(open_store(Settings(data_dir=data_dir)), key)
    assert manifest is not None and len(manifest.buckets) == 1, manifest
    return sorted(f.path for f in manifest.buckets[0].files)


@pytest.mark.slow
def test_an_llm_compiles_on_the_embedded_default_and_boots_a_vllm_host_offline(
        dev: Dev, tiny_checkpoints: Checkpoints) -> None:
    # The embedded worker took the Neuron environment dev was started in: it serves the release's NxDI queue.
    assert dev.serves == ("worker compiles for: cpu (torch 2.13.0); inf2, trn1, trn2 (Neuron SDK 2.27.1: neuronx-cc, "
                          "neuronx-cc-tp, nxdi, trace, trace-tp)"), dev.serves
    # 1. A local checkpoint directory (file://), pre-sharded weights: the artifact is all vLLM needs.
    local = dev.spec("local", tiny_checkpoints.base.as_uri(), save_sharded_checkpoint=True)
    submitted = dev.run("submit", str(local), "--timeout", "240", "--poll", "0.3")
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    key = submitted.stdout.strip()
    assert re.search(r"^bucket 0 \(the whole NxDI model\): \w+ -> succeeded in ", submitted.stderr, re.M), \
        submitted.stderr
    assert _published_files(dev.data_dir, key) == [
        "model.pt", "neuron_config.json", "weights/tp0_sharded_checkpoint.safetensors"]

    # 2. The checkpoint uploaded as a tar archive, weights sharded at load: one compile serves its fine-tune too.
    archives = {}
    for name, directory in (("base", tiny_checkpoints.base), ("fine-tune", tiny_checkpoints.fine_tune)):
        (dev.tmp / f"{name}.tar").write_bytes(tar_of(directory, top=name))
        uploaded = dev.run("upload", str(dev.tmp / f"{name}.tar"))
        assert uploaded.returncode == 0, uploaded.stderr
        archives[name] = uploaded.stdout.strip()
    assert archives["base"].startswith("blob:sha256:") and archives["base"] != archives["fine-tune"]
    uploaded_spec = dev.spec("uploaded", archives["base"])
    shard_on_load = dev.run("submit", str(uploaded_spec), "--timeout", "240", "--poll", "0.3")
    assert shard_on_load.returncode == 0, shard_on_load.stdout + shard_on_load.stderr
    weightless = shard_on_load.stdout.strip()
    assert weightless != key and _published_files(dev.data_dir, weightless) == ["model.pt", "neuron_config.json"]
    tuned = dev.run("submit", str(dev.spec("tuned", archives["fine-tune"])), "--timeout", "60",
                    "--poll", "0.3")
    assert tuned.returncode == 0 and tuned.stdout.strip() == weightless, tuned.stdout + tuned.stderr

    # 3. A fleet host fetches by spec while the API is up; then the service stops and it boots from its cache.
    for spec in (local, uploaded_spec):
        fetched = dev.run("fetch", "--spec", str(spec))
        assert fetched.returncode == 0, fetched.stderr
    dev.stop()
    offline = dev.run("fetch", "--spec", str(local), "--offline")
    assert offline.returncode == 0, offline.stderr
    directory = Path(offline.stdout.strip())
    assert directory == dev.tmp / "cache" / "v1" / "artifacts" / key and "all from the cache" in offline.stderr

    printed = dev.run("serve-env", "--spec", str(local), "--offline", "-q")
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.splitlines() == [
        f"export NEURON_COMPILED_ARTIFACTS={directory / 'bucket-0'}",
        "export VLLM_NEURON_FRAMEWORK=neuronx-distributed-inference",
        f"VLLM_SERVE_ARGS='{' '.join(MATCHING)}'"]
    accepted = dev.run("serve-env", "--spec", str(local), "--offline", "--", "serve", "/models/tiny", *MATCHING)
    assert accepted.returncode == 0, accepted.stderr
    assert accepted.stderr == f"{key}: the vLLM arguments match the artifact\n"
    for argv, line in (
            (["--tensor-parallel-size", "2", *MATCHING[2:]],
             "error: --tensor-parallel-size 2 but the artifact was compiled for tp_degree 1\n"),
            ([*MATCHING[:4], "--max-model-len", "256", *MATCHING[6:]],
             "error: --max-model-len 256 but the artifact was compiled for seq_len 128\n")):
        refused = dev.run("serve-env", "--spec", str(local), "--offline", "--", *argv)
        assert (refused.returncode, refused.stdout, refused.stderr) == (4, "", line)

    # The weight-free artifact: vLLM would find no weights in it, so serve-env links the checkpoint beside it.
    checkpoint, serving = tiny_checkpoints.base, dev.tmp / "serving"
    bare = dev.run("serve-env", "--spec", str(uploaded_spec), "--offline", "--", *MATCHING)
    assert bare.returncode == 4 and "give serve-env --checkpoint CKPT --serving-dir DIR" in bare.stderr
    linked = dev.run("serve-env", "--spec", str(uploaded_spec), "--offline", "-q", "--checkpoint", str(checkpoint),
                     "--serving-dir", str(serving), "--", "--model", str(checkpoint), *MATCHING)
    assert linked.returncode == 0, linked.stderr
    assert linked.stdout.splitlines()[0] == f"export NEURON_COMPILED_ARTIFACTS={serving}"
    assert (serving / "model.safetensors").resolve() == (checkpoint / "model.safetensors").resolve()
    mismatched = dev.run("serve-env", "--spec", str(uploaded_spec), "--offline", "--checkpoint", str(checkpoint),
                         "--serving-dir", str(serving), "--", "--model", str(checkpoint), *MATCHING[:6],
                         "--dtype", "float16")
    assert (mismatched.returncode, mismatched.stderr) == (
        4, "error: --dtype float16 but the artifact was compiled for torch_dtype bfloat16\n")


@pytest.mark.slow
def test_docs_llm_trying_it_locally_runs_as_written(tmp_path: Path, tiny_checkpoints: Checkpoints) -> None:
    """docs/llm.md's "Trying it locally": its first block in one shell (the Neuron environment being the double's),
    its second in another of the same directory; only the port and the serving directory are the test's."""
    shutil.copytree(tiny_checkpoints.base, tmp_path / "llama-checkpoint")
    port = free_port()
    start = fill(doc_block("llm.md", "## Trying it locally"), {"compilesvc dev ": f"compilesvc dev --port {port} "})
    steps = fill(doc_block("llm.md", "once it printed `compilesvc is up`"),
                 {"/tmp/llama": str(tmp_path / "serving")})
    bin_dir = str(Path(sys.executable).parent)
    shell = neuron_double_env(_clean_environ(), sdk=None, devices=0)  # the SDK's environment; the block names it
    shell["PATH"] = f"{bin_dir}:{shell['PATH']}"
    service = subprocess.Popen(["sh", "-c", start], env=shell, cwd=tmp_path, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        assert service.stdout is not None
        for line in service.stdout:
            if line.startswith("compilesvc is up"):
                break
        else:
            pytest.fail(f"the block did not start compilesvc dev (exit {service.wait()})")
        other = {**_clean_environ(), "PATH": f"{bin_dir}:{os.environ['PATH']}",
                 "COMPILESVC_API_URL": f"http://127.0.0.1:{port}", "COMPILESVC_CACHE_DIR": str(tmp_path / "cache")}
        run = subprocess.run(["bash", "-e", "-c", steps], env=other, cwd=tmp_path, capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stdout + run.stderr
        key = run.stdout.splitlines()[0]
        assert run.stdout.splitlines()[1:] == [
            str(tmp_path / "cache" / "v1" / "artifacts" / key),
            f"export NEURON_COMPILED_ARTIFACTS={tmp_path / 'serving'}",
            "export VLLM_NEURON_FRAMEWORK=neuronx-distributed-inference",
            "VLLM_SERVE_ARGS='--tensor-parallel-size 2 --max-num-seqs 1 --max-model-len 1024 --dtype bfloat16'"]
        assert run.stderr.endswith(f"{key}: the vLLM arguments match the artifact\n"), run.stderr
    finally:
        os.killpg(service.pid, signal.SIGTERM)
        service.wait(60)
