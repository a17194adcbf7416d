"""Trn3 and logical NeuronCores against the Neuron TEST DOUBLE (issue 28, deliverables 2 and 5).

Sources the double follows (tests/doubles/neuron/_release.py cites them where it imitates them):

- trn3 is an instance family of releases from 2.29.0: n2-manifest.json lists ``trn3`` in the
  ``supported_instances`` of neuronx-cc from 2.29.0 on (aws-neuron/aws-neuron-sdk src/helperscripts/
  n2-manifest.json, manifest_version 2.32.0); NKI's quickstart compiles with
  ``NEURON_PLATFORM_TARGET_OVERRIDE=trn3`` (nki/get-started/quickstart-implement-run-kernel.rst).
- the compiler's logical NeuronCore default is 2 on trn2 (compiler CLI reference: "Only available on trn2;
  Default: 2") and, per NxD's and NxDI's ``get_platform_lnc``, on trn3; LNC 2 elsewhere is NCC_EARG001.
- ModelBuilder lays out its process groups for ``logical_nc_config`` (default 1) and does not pass ``--lnc`` to
  the main compile (neuronx-distributed src/neuronx_distributed/trace/model_builder.py, Release 2.29).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.doubles import NEURON_DOUBLE_DIR, neuron_double_env
from tests.workers import run_child, text_inputs
from workers.isolation.child_env import child_environment_for

MakeCluster = Callable[..., Any]
TRN3_RELEASE = "2.31.1"  # the newest release with torch-neuronx and NxD, and trn3 (from 2.29.0)




def _device_less(tmp_path: Path, target: str, sdk: str) -> dict[str, str]:
    """A device-less host of ``sdk`` with the child environment the runner gives ``target`` compiles."""
    return {**neuron_double_env(sdk=sdk, devices=0), **child_environment_for(target),
            "COMPILESVC_NEURON_DEVICE_GLOB": str(tmp_path / "no-devices" / "neuron[0-9]*")}


def _neff(run: Any, name: str = "graph.neff") -> dict[str, str]:
    neff = next((run.work_dir / "neuron").rglob(name))
    return dict(line.split("=", 1) for line in neff.read_text().splitlines() if "=" in line)


def _double_compile(tmp_path: Path, release: str, *args: str) -> subprocess.CompletedProcess[str]:
    model = tmp_path / "model.hlo.pb"
    model.write_bytes(b"HloModule double\n")
    env = neuron_double_env(sdk=release)
    return subprocess.run([sys.executable, str(NEURON_DOUBLE_DIR / "bin" / "neuronx-cc"), "compile", str(model),
                           "--framework", "XLA", "--output", str(tmp_path / "out.neff"), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)


def test_the_double_compiler_takes_trn3_from_2_29_0_and_lnc_2_only_on_trn2_and_trn3(tmp_path: Path) -> None:
    refused = _double_compile(tmp_path, "2.28.0", "--target", "trn3")
    assert refused.returncode == 2 and "argument --target: invalid choice: 'trn3'" in refused.stderr
    taken = _double_compile(tmp_path, "2.29.0", "--target", "trn3")
    assert taken.returncode == 0, taken.stdout + taken.stderr
    assert "target=trn3\n" in (tmp_path / "out.neff").read_text() and "lnc=2\n" in (tmp_path / "out.neff").read_text()
    earg = _double_compile(tmp_path, "2.27.1", "--target", "trn1", "--lnc", "2")
    assert earg.returncode == 70 and "[NCC_EARG001]" in earg.stdout


def test_a_trn3_trace_compiles_for_trn3_with_its_logical_neuroncores(tmp_path: Path, scripted: str) -> None:
    run = run_child(tmp_path, "trn3", env=_device_less(tmp_path, "trn3", TRN3_RELEASE), backend="trace",
                    target="trn3", sdk=TRN3_RELEASE, args=[], inputs=text_inputs(2, 16), model_path=scripted,
                    model_format="torchscript")
    assert run.returncode == 0, run.describe()
    assert "platform target frozen at import: trn3; cpu_backend=True" in run.stdout
    assert _neff(run) == {"target": "trn3", "lowered_for": "trn3", "neuronx_cc": "2.26.6360.0", "lnc": "2"}
    assert run.result is not None and run.result["versions"]["target"] == "trn3"


@pytest.mark.parametrize(("args", "fields", "lnc"), [
    ([], {}, "2"),  # a request without lnc (a key made before schema 4): the target's default
    (["--logical-nc-config=1"], {}, "1"),  # such a request whose spec gave the flag
    ([], {"lnc": 1}, "1"),  # a schema-4 request: toolchain.lnc, resolved at submit
])
def test_tp_on_trn2_gives_model_builder_the_compilers_logical_neuroncores(tmp_path: Path, scripted: str,
                                                                         args: list[str], fields: dict[str, Any],
                                                                         lnc: str) -> None:
    """NxD's replica groups and the compiled program must agree on the LNC; the compiler's default (2 on trn2)
    is not ModelBuilder's (1), so the backend resolves it and gives both the same value."""
    run = run_child(tmp_path, "mb", env=_device_less(tmp_path, "trn2", "2.27.1"), backend="trace", target="trn2",
                    sdk="2.27.1", args=args, tp_degree=2, inputs=text_inputs(2, 16), model_path=scripted,
                    model_format="torchscript", **fields)
    assert run.returncode == 0, run.describe()
    neff = _neff(run)
    assert (neff["lnc"], neff["nxd_logical_nc_config"]) == (lnc, lnc)
    assert f"logical_nc_config={lnc}" in run.stdout


def test_a_trn3_hlo_spec_builds_end_to_end_and_a_trn3_spec_before_2_29_is_refused(make_cluster: MakeCluster) -> None:
    from compilesvc.lifecycle.artifacts import read_manifest
    from compilesvc.spec.parsing import SpecError

    cluster = make_cluster()
    spec = {**cluster.hlo_spec(sdk=TRN3_RELEASE), "target": "trn3"}
    with pytest.raises(SpecError, match=r"Neuron SDK 2\.28\.0.*trn3|trn3.*Neuron SDK 2\.28\.0"):
        cluster.submit({**spec, "sdk": "2.28.0"})

    env = neuron_double_env({"PYTHONPATH": os.environ.get("PYTHONPATH", ""), "PATH": os.environ["PATH"]},
                            sdk=TRN3_RELEASE)
    cluster.start_worker("wtrn3", concurrency=1, env={k: env[k] for k in (
        "PYTHONPATH", "PATH", "COMPILESVC_NEURON_SDK", "COMPILESVC_NEURON_DOUBLE_RELEASE")})
    cluster.start_relay()
    result = cluster.submit(spec)
    artifact = cluster.wait_artifact(result.artifact_key, ("published", "failed"), timeout=120)
    assert artifact.state == "published", [cluster.bucket(b.key).error_message for b in result.buckets]
    assert artifact.material["toolchain"]["lnc"] == 2
    manifest = read_manifest(cluster.services.store, result.artifact_key)
    assert manifest is not None
    [neff] = [f for entry in manifest.buckets for f in entry.files if f.path == "model.neff"]
    with cluster.services.store.open_blob(neff.sha256) as blob:
        recorded = dict(line.split("=", 1) for line in blob.read().decode(errors="replace").splitlines()
                        if "=" in line)
    assert (recorded["target"], recorded["lnc"]) == ("trn3", "2")


def test_a_trn3_tp_trace_spec_builds_end_to_end(make_cluster: MakeCluster, tiny_torch_model: Path) -> None:
    """A trn3 trace at tp_degree 2 (ModelBuilder, 2.31.1) through the whole service: one model.pt and a weights
    shard per rank, keyed with the resolved LNC (trn3's default, 2)."""
    from compilesvc.lifecycle.artifacts import read_manifest

    cluster = make_cluster()
    uri = cluster.upload(tiny_torch_model.read_bytes(), "tiny.pt2")
    spec = {"model": {"uri": uri, "format": "exported-program", "name": "tiny"}, "target": "trn3",
            "sdk": TRN3_RELEASE, "compiler": {"tp_degree": 2}, "buckets": [{"batch_size": 1, "seq_len": 8}]}
    env = neuron_double_env({"PYTHONPATH": os.environ.get("PYTHONPATH", ""), "PATH": os.environ["PATH"]},
                            sdk=TRN3_RELEASE, devices=0)
    cluster.start_worker("wtrn3", concurrency=1, env={k: env[k] for k in (
        "PYTHONPATH", "PATH", "COMPILESVC_NEURON_SDK", "COMPILESVC_NEURON_DOUBLE_RELEASE",
        "COMPILESVC_NEURON_DOUBLE_DEVICES")})
    cluster.start_relay()
    result = cluster.submit(spec)
    # 2.31.0 ships the same toolchain, so the queue is named for it (compilesvc.dispatch.routing).
    assert cluster.bucket(result.buckets[0].key).queue == "compile.trn3.2.31.0.trace-tp"
    artifact = cluster.wait_artifact(result.artifact_key, ("published", "failed"), timeout=180)
    assert artifact.state == "published", [cluster.bucket(b.key).error_message for b in result.buckets]
    assert (artifact.material["toolchain"]["target"], artifact.material["toolchain"]["lnc"]) == ("trn3", 2)
    manifest = read_manifest(cluster.services.store, result.artifact_key)
    assert manifest is not None
    assert sorted(f.path for entry in manifest.buckets for f in entry.files) == [
        "model.pt", "weights/tp0_sharded_checkpoint.safetensors", "weights/tp1_sharded_checkpoint.safetensors"]
