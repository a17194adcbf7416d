"""The nxdi backend through the real compile child, against the NxD Inference TEST DOUBLE.

The checkpoint is real: a tiny Llama built and saved by ``transformers`` (random weights, no download). The double
(tests/doubles/neuron/neuronx_distributed_inference) stands in for NxDI, which cannot be installed here. What is
tested is our code: the environment the compile gets, the request it reads, the directory it reports, and how each
failure is classified; and, where a behaviour of NxDI is subtle, that the double has it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from compilesvc.spec.nxdi_config import canonical_neuron_config
from tests.doubles import RELEASE_TRANSFORMERS, neuron_double_env
from tests.doubles.neuron._release import RELEASES
from tests.fixtures.checkpoints import Checkpoints
from tests.workers import PYTHON, REPO, run_child, run_children
from workers.compiling.classify import classify

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

SDK = "2.27.1"
NXDI = RELEASES[SDK].nxdi
BASE = {"tp_degree": 1, "batch_size": 1, "seq_len": 256}


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoints: Checkpoints) -> dict[str, Path]:
    """A base model and a fine-tune: the same config.json, other weights (the session's, made once per process)."""
    return {"base": tiny_checkpoints.base, "tuned": tiny_checkpoints.fine_tune}


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A device-less host with the SDK 2.27.1 double (NxDI 0.7.15063); no platform override inherited. Tests
    that change it change a copy."""
    env = neuron_double_env(sdk=SDK, devices=0)
    env.pop("NEURON_PLATFORM_TARGET_OVERRIDE", None)
    return {**env, "COMPILESVC_NEURON_DEVICE_GLOB": str(tmp_path_factory.mktemp("no-devices") / "neuron[0-9]*")}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str],
             checkpoints: dict[str, Path]) -> Callable[..., Any]:
    """A successful compile that several tests only read, run once per module: ``compiled(checkpoint, **config)``
    is the same run for the same arguments (each compile child costs seconds: torch and transformers)."""
    root = tmp_path_factory.mktemp("shared-compiles")
    runs: dict[str, Any] = {}

    def compile_(checkpoint: str, **neuron_config: Any) -> Any:
        key = json.dumps([checkpoint, neuron_config], sort_keys=True)
        if key not in runs:
            run = _nxdi(root, f"shared-{len(runs)}", env, checkpoints[checkpoint], **neuron_config)
            assert run.returncode == 0, run.describe()
            runs[key] = run
        return runs[key]

    return compile_


def _nxdi(tmp_path: Path, name: str, env: dict[str, str], checkpoint: Path, target: str = "trn1",
          **neuron_config: Any) -> Any:
    fields: dict[str, Any] = {}
    if "nxdi_model" in neuron_config:
        fields["nxdi_model"] = neuron_config.pop("nxdi_model")
    return run_child(tmp_path, name, env=env, backend="nxdi", target=target, sdk=SDK, model_path=str(checkpoint),
                     model_format="hf-checkpoint", inputs=[], neuron_config={**BASE, **neuron_config}, **fields)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _neff(run: Any, tag: str = "context_encoding_model") -> dict[str, str]:
    neff = run.work_dir / "nxd_model" / tag / "_tp0_bk0" / "model" / "graph.neff"
    return dict(line.split("=", 1) for line in neff.read_text(errors="replace").splitlines() if "=" in line)


def _outcome(run: Any) -> Any:
    return classify(run.returncode, run.result, run.lines[-200:], timed_out=False, cancelled=False)


def test_shard_on_load_writes_config_then_model_and_no_weights(compiled: Callable[..., Any],
                                                              checkpoints: dict[str, Path]) -> None:
    import torch

    run = compiled("base")
    files = {f["path"]: f for f in run.result["files"]}
    assert {p: f["role"] for p, f in files.items()} == {"model.pt": "model", "neuron_config.json": "aux"}
    for path, entry in files.items():
        assert entry["sha256"] == _sha256(run.out_dir / path) and entry["bytes"] == (run.out_dir / path).stat().st_size
    stored = json.loads((run.out_dir / "neuron_config.json").read_text())
    # NxDI copies AutoConfig's dict as it is: the checkpoint's path is in the file (docs/research/nxdi.md Q3).
    assert stored["_name_or_path"] == str(checkpoints["base"])
    assert stored["neuron_config"]["tp_degree"] == 1 and stored["neuron_config"]["save_sharded_checkpoint"] is False
    assert "SKIPPING pre-sharding the checkpoints" in run.stdout + run.stderr
    assert torch.jit.load(str(run.out_dir / "model.pt")) is not None  # a real TorchScript file
    versions = run.result["versions"]
    assert versions["neuronx_distributed_inference"] == NXDI and versions["neuron_sdk"] == SDK


def test_pre_sharding_writes_one_safetensors_file_per_rank_from_the_checkpoint(
        compiled: Callable[..., Any], checkpoints: dict[str, Path]) -> None:
    run = compiled("base", tp_degree=2, save_sharded_checkpoint=True)
    shards = {f["path"]: f for f in run.result["files"] if f["role"] == "weights-shard"}
    assert sorted(shards) == [f"weights/tp{rank}_sharded_checkpoint.safetensors" for rank in (0, 1)]
    assert [shards[p]["rank"] for p in sorted(shards)] == [0, 1]
    original = safetensors_torch.load_file(str(checkpoints["base"] / "model.safetensors"))
    rank1 = safetensors_torch.load_file(str(run.out_dir / "weights/tp1_sharded_checkpoint.safetensors"))
    # The "model." prefix is NxDI's to drop (get_state_dict); the rows are split over the ranks.
    assert rank1["embed_tokens.weight"].equal(original["model.embed_tokens.weight"].chunk(2)[1])


def test_model_pt_does_not_depend_on_the_weights(compiled: Callable[..., Any]) -> None:
    # Two ranks: the base's compile is the pre-sharding test's.
    runs = [compiled(name, tp_degree=2, save_sharded_checkpoint=True) for name in ("base", "tuned")]
    base, tuned = ({f["path"]: f["sha256"] for f in run.result["files"]} for run in runs)
    assert base["model.pt"] == tuned["model.pt"]  # one compile serves a base model and its fine-tunes
    shard = "weights/tp0_sharded_checkpoint.safetensors"
    assert base[shard] != tuned[shard]  # the pre-sharded weights are the weights
    configs = [json.loads((run.out_dir / "neuron_config.json").read_text()) for run in runs]
    for config in configs:
        config.pop("_name_or_path")
    assert configs[0] == configs[1]


def test_a_shard_on_load_compile_reads_config_json_alone(tmp_path: Path, env: dict[str, str],
                                                         checkpoints: dict[str, Path]) -> None:
    bare = tmp_path / "config-only"
    bare.mkdir()
    (bare / "config.json").write_bytes((checkpoints["base"] / "config.json").read_bytes())
    run = _nxdi(tmp_path, "bare", env, bare)
    assert run.returncode == 0, run.describe()
    # Pre-sharding reads the weights: a checkpoint without them fails for good, naming what is missing.
    run = _nxdi(tmp_path, "bare-presharded", env, bare, save_sharded_checkpoint=True)
    assert run.returncode == 3, run.describe()
    assert run.result["code"] == "NXDI_WEIGHTS_MISSING"
    assert f"Can not find model.safetensors or pytorch_model.bin in {bare}" in run.result["message"]


def test_the_target_is_in_the_environment_before_nxdi_is_imported(tmp_path: Path, env: dict[str, str],
                                                                   checkpoints: dict[str, Path]) -> None:
    assert "NEURON_PLATFORM_TARGET_OVERRIDE" not in env
    run = _nxdi(tmp_path, "trn2", env, checkpoints["base"], target="trn2")
    assert run.returncode == 0, run.describe()
    # No --target in Llama's flags: the platform the library saw at import, and NxDI's platform LNC (2 on trn2).
    assert _neff(run)["target"] == "trn2" and _neff(run)["lnc"] == "2"
    other = _nxdi(tmp_path, "inf2", env, checkpoints["base"], target="inf2")
    assert _neff(other)["target"] == "inf2" and _neff(other)["lnc"] == "1"
    assert _sha256(run.out_dir / "model.pt") != _sha256(other.out_dir / "model.pt")


def test_two_compiles_at_once_have_their_own_work_dirs(tmp_path: Path, env: dict[str, str],
                                                       checkpoints: dict[str, Path]) -> None:
    # NxD wipes BASE_COMPILE_WORK_DIR at each trace and reads the NEFFs back from it: a shared one breaks both.
    slow = {**env, "COMPILESVC_NEURON_DOUBLE_NXDI_SECONDS": "2", "BASE_COMPILE_WORK_DIR": str(tmp_path / "shared")}
    fields = {"backend": "nxdi", "target": "trn1", "sdk": SDK, "model_format": "hf-checkpoint", "inputs": [],
              "neuron_config": BASE}
    runs = run_children(tmp_path, [(name, {**fields, "model_path": str(checkpoints[name])})
                                   for name in ("base", "tuned")], env=slow)
    assert [run.returncode for run in runs] == [0, 0], [run.describe() for run in runs]
    for run in runs:
        assert f"BASE_COMPILE_WORK_DIR={run.work_dir / 'nxd_model'}" in run.stdout
        assert (run.work_dir / "nxd_model" / "neuron_config.json").is_file()
    assert not (tmp_path / "shared").exists()
    assert _sha256(runs[0].out_dir / "model.pt") == _sha256(runs[1].out_dir / "model.pt")


def test_f137_is_the_hosts_memory_never_a_compile_error(tmp_path: Path, env: dict[str, str],
                                                        checkpoints: dict[str, Path]) -> None:
    small = {**env, "COMPILESVC_NEURON_DOUBLE_NXDI_MEMORY_MB": "65536",
             "COMPILESVC_NEURON_DOUBLE_NXDI_HOST_MEMORY_MB": "16384"}
    run = _nxdi(tmp_path, "f137", small, checkpoints["base"])
    assert run.returncode == 4, run.describe()
    assert (run.result["status"], run.result["code"]) == ("infra_error", "HOST_OOM")
    message = run.result["message"]
    assert "[F137] neuronx-cc was forcibly killed" in message and "of memory" in message
    assert "COMPILESVC_SANDBOX_MEMORY_MB" in message


def test_a_compile_killed_for_memory_is_infrastructure_naming_the_memory(tmp_path: Path, env: dict[str, str],
                                                                          checkpoints: dict[str, Path]) -> None:
    killed = {**env, "COMPILESVC_NEURON_DOUBLE_NXDI_MEMORY_MB": "65536",
              "COMPILESVC_NEURON_DOUBLE_NXDI_HOST_MEMORY_MB": "16384", "COMPILESVC_NEURON_DOUBLE_NXDI_OOM": "sigkill"}
    run = _nxdi(tmp_path, "sigkill", killed, checkpoints["base"])
    assert run.returncode == -signal.SIGKILL and run.result is None, run.describe()
    assert "generating HLO: context_encoding_model" in run.stdout + run.stderr
    outcome = _outcome(run)
    assert (outcome.error_class, outcome.code) == ("infra", "SIGKILL")
    assert "possibly OOM-killed" in outcome.message and "of memory" in outcome.message


@pytest.mark.parametrize(("neuron_config", "field", "text"), [
    ({"seq_len": 2048, "enable_bucketing": True, "context_encoding_buckets": [512, 4096]},
     "neuron_config.context_encoding_buckets", "Context bucket 4096 should be <= 2048"),
    ({"seq_len": 256, "max_context_length": 512}, "neuron_config.max_context_length",
     "max_context_length cannot be more than max_length"),
    ({"torch_dtype": "int8"}, "neuron_config.torch_dtype", "Unsupported dtype: int8"),
    ({"cast_type": "always"}, "neuron_config.cast_type", "cast_type must be one of config, as-declared"),
    ({"tp_degree": 4, "cp_degree": 3}, "neuron_config.cp_degree", "TP Degree must be evenly divisible by CP Degree"),
    ({"is_block_kv_layout": True, "chunked_prefill_config": {"max_num_seqs": 2}},
     "neuron_config.chunked_prefill_config", "Chunked Prefill is not available in NxDI for now"),
    ({"quantized": True}, "neuron_config.quantized_checkpoints_path", "quantized_checkpoints_path is required"),
])
def test_a_configuration_nxdi_refuses_is_final_and_names_the_field(
        tmp_path: Path, env: dict[str, str], checkpoints: dict[str, Path], neuron_config: dict[str, Any],
        field: str, text: str) -> None:
    run = _nxdi(tmp_path, "bad", env, checkpoints["base"], **neuron_config)
    assert run.returncode == 3, run.describe()
    assert run.result["code"] == "NXDI_CONFIG_ERROR"
    assert run.result["message"].startswith(f"{field}: ") and text in run.result["message"]
    assert not (run.out_dir / "model.pt").exists()


def test_a_checkpoint_lacking_what_the_model_needs_is_final(tmp_path: Path, env: dict[str, str],
                                                            checkpoints: dict[str, Path]) -> None:
    mixtral = "neuronx_distributed_inference.models.mixtral.modeling_mixtral:NeuronMixtralForCausalLM"
    run = _nxdi(tmp_path, "mixtral", env, checkpoints["base"], nxdi_model=mixtral)
    assert run.returncode == 3, run.describe()
    assert run.result["code"] == "NXDI_CONFIG_ERROR"
    assert "Config must define ['num_local_experts', 'num_experts_per_tok']" in run.result["message"]

    other = tmp_path / "gpt2"
    other.mkdir()
    config = json.loads((checkpoints["base"] / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    run = _nxdi(tmp_path, "gpt2", env, other)
    assert (run.returncode, run.result["code"]) == (3, "NXDI_UNSUPPORTED_ARCHITECTURE"), run.describe()
    assert "'GPT2LMHeadModel'" in run.result["message"]


def test_unknown_neuron_config_keys_are_only_warned_about_by_nxdi(tmp_path: Path, env: dict[str, str],
                                                                  checkpoints: dict[str, Path]) -> None:
    # NXDI config.py:L639-L640: a misspelt field compiles with the default (so compilesvc's spec refuses it).
    run = _nxdi(tmp_path, "typo", env, checkpoints["base"], tp_degre=2)
    assert run.returncode == 0, run.describe()
    assert "NeuronConfig init: Unexpected keyword arguments: {'tp_degre': 2}" in run.stdout + run.stderr
    assert json.loads((run.out_dir / "neuron_config.json").read_text())["neuron_config"]["tp_degree"] == 1


def test_torch_dtype_comes_from_the_checkpoint_unless_given(compiled: Callable[..., Any]) -> None:
    def stored(run: Any) -> dict[str, Any]:
        return dict(json.loads((run.out_dir / "neuron_config.json").read_text())["neuron_config"])

    hf = stored(compiled("base"))  # config.json says float32 (hf_adapter.py:L58-L67)
    assert (hf["torch_dtype"], hf["overrides_torch_dtype"]) == ("float32", False)
    given = stored(compiled("base", torch_dtype="bfloat16"))
    assert (given["torch_dtype"], given["overrides_torch_dtype"]) == ("bfloat16", True)


def test_the_short_bucket_form_becomes_nxdis_bucket_lists(tmp_path: Path, env: dict[str, str],
                                                          checkpoints: dict[str, Path]) -> None:
    # The short form is expanded where the key is made (the spec's canonical NeuronConfig), which the worker gets.
    canonical = canonical_neuron_config(SDK, "trn1", {**BASE, "seq_len": 512, "max_context_length": 256,
                                                      "buckets": [128, 256, 512]})
    run = _nxdi(tmp_path, "buckets", env, checkpoints["base"], **canonical)
    assert run.returncode == 0, run.describe()
    stored = json.loads((run.out_dir / "neuron_config.json").read_text())["neuron_config"]
    assert stored["enable_bucketing"] is True
    assert (stored["context_encoding_buckets"], stored["token_generation_buckets"]) == ([128, 256], [128, 256, 512])
    compiled = sorted(p.parents[2].name + "/" + p.parents[1].name
                      for p in (run.work_dir / "nxd_model").rglob("graph.neff"))
    assert compiled == ["context_encoding_model/_tp0_bk0", "context_encoding_model/_tp0_bk1",
                        "token_generation_model/_tp0_bk0", "token_generation_model/_tp0_bk1",
                        "token_generation_model/_tp0_bk2"]


@pytest.mark.parametrize(("installed", "claimed", "transformers", "why"), [
    (SDK, SDK, RELEASE_TRANSFORMERS, None),
    ("2.29.0", "2.29.0", RELEASE_TRANSFORMERS, None),
    ("2.32.0", "2.32.0", RELEASE_TRANSFORMERS, "Neuron SDK 2.32.0 ships no neuronx-distributed-inference"),
    ("2.29.0", SDK, RELEASE_TRANSFORMERS,
     f"neuronx-distributed-inference 0.9.17334 is installed, Neuron SDK {SDK} ships {NXDI}"),
    # NxDI 0.7 pins transformers==4.56.* (v0.7.14366 setup.py), our table 4.56.2: another patch is refused too.
    (SDK, SDK, "4.56.1", f"transformers 4.56.1 is installed, neuronx-distributed-inference {NXDI} (Neuron SDK {SDK}) "
                         "compiles with 4.56.2"),
    (SDK, SDK, "4.57.6", f"transformers 4.57.6 is installed, neuronx-distributed-inference {NXDI} (Neuron SDK {SDK}) "
                         "compiles with 4.56.2"),
    ("2.29.0", "2.29.0", "4.56.2", "transformers 4.56.2 is installed, neuronx-distributed-inference 0.9.17334 "
                                   "(Neuron SDK 2.29.0) compiles with 4.57.6"),
])
def test_a_worker_offers_nxdi_only_with_its_releases_nxdi_installed(installed: str, claimed: str,
                                                                    transformers: str | None, why: str | None) -> None:
    double = neuron_double_env(sdk=claimed, installed=installed, transformers=transformers)
    env = {**double, "PYTHONPATH": os.pathsep.join([double["PYTHONPATH"], str(REPO)])}
    probe = "from workers.host.versions import nxdi_unavailable as u; import sys; print(u(sys.argv[1]))"
    out = subprocess.run([PYTHON, "-c", probe, claimed], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(why), out.stderr


def test_the_request_of_an_nxdi_compile(tmp_path: Path) -> None:
    from workers.compiling.contract import CompileRequest, RequestError

    request = {"backend": "nxdi", "target": "trn2", "sdk": SDK, "model_path": str(tmp_path / "checkpoint"),
               "model_format": "hf-checkpoint", "inputs": [], "out_dir": str(tmp_path / "out"),
               "work_dir": str(tmp_path / "work"), "neuron_config": BASE}
    parsed = CompileRequest.from_json(request)
    assert parsed.inputs == () and parsed.neuron_config == BASE and parsed.nxdi_model is None
    for change, field in [({"neuron_config": None}, "neuron_config"), ({"nxdi_model": "NoModule"}, "nxdi_model"),
                          ({"model_format": "hf-dir"}, "model_format")]:
        with pytest.raises(RequestError, match=rf"^{field}: "):
            CompileRequest.from_json({**request, **change})
    trace = {**request, "backend": "trace", "model_format": "hf-dir", "neuron_config": None}
    with pytest.raises(RequestError, match=r"^inputs: "):  # shape buckets stay required for every other backend
        CompileRequest.from_json(trace)
    with pytest.raises(RequestError, match=r"^neuron_config: only an nxdi compile"):
        CompileRequest.from_json({**trace, "inputs": [{"name": "x", "shape": [1], "dtype": "int64"}],
                                  "neuron_config": BASE})


def test_a_host_with_another_releases_nxdi_is_refused_before_compiling(tmp_path: Path,
                                                                       checkpoints: dict[str, Path]) -> None:
    env = neuron_double_env(sdk=SDK, installed="2.29.0", devices=0)  # NxDI 0.9.17334 where 2.27.1 ships 0.7.15063
    run = _nxdi(tmp_path, "wrong", env, checkpoints["base"])
    assert (run.returncode, run.result["code"]) == (4, "TOOLCHAIN_MISMATCH"), run.describe()
    assert (f"neuronx-distributed-inference 0.9.17334 is installed, Neuron SDK {SDK} ships {NXDI}"
            in run.result["message"])
    assert not (run.out_dir / "model.pt").exists()


def test_a_host_whose_transformers_is_not_its_nxdis_is_refused_before_compiling(
        tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    # The venv's real transformers shows (4.57.6, the 0.8+ lines'), where 2.27.1's NxDI 0.7 compiles with 4.56.2:
    # its config defaults may differ, and the key (which names NxDI 0.7.15063) would not say so.
    env = neuron_double_env(sdk=SDK, devices=0, transformers=None)
    real = importlib.metadata.version("transformers")
    assert real != "4.56.2", "the venv's transformers is 2.27.1's: pick a release whose NxDI line differs"
    run = _nxdi(tmp_path, "transformers", env, checkpoints["base"])
    assert (run.returncode, run.result["code"]) == (4, "TOOLCHAIN_MISMATCH"), run.describe()
    assert (f"transformers {real} is installed, neuronx-distributed-inference {NXDI} (Neuron SDK {SDK}) "
            "compiles with 4.56.2") in run.result["message"]
    assert not (run.out_dir / "model.pt").exists()


_PROBE = """
import json, logging, os, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
from neuronx_distributed_inference.models.config import NeuronConfig
for case in json.loads(sys.argv[1]):
    os.environ.clear()
    os.environ.update(case["env"])
    print("--- case " + case["id"], flush=True)
    try:
        config = NeuronConfig(**case["kwargs"])
    except Exception as exc:
        print(f"raised {type(exc).__name__}: {exc}", flush=True)
    else:
        print("override=" + str(os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE")), flush=True)
"""

#: (release, simulated devices, NEURON_PLATFORM_TARGET_OVERRIDE or None for unset, NeuronConfig kwargs, expected).
_RELEASE_CASES = [
    # dma_order_config is popped from 2.28 (NxDI cd3abf3): on 2.27.1 it is an unknown keyword, only warned about.
    ("2.27.1", 0, "trn1", {"dma_order_config": None},
     "NeuronConfig init: Unexpected keyword arguments: {'dma_order_config'"),
    ("2.28.0", 0, "trn1", {"dma_order_config": None}, "override=trn1"),
    ("2.27.1", 0, "trn1", {"torch_dtype": "float8_e5m2"}, "override=trn1"),
    ("2.27.1", 0, "trn1", {"torch_dtype": "fp16"}, "raised AssertionError: Unsupported dtype: fp16"),
]
_OVERRIDE_CASES = [
    # 2.29 writes the platform into the environment when it is unset (config.py:L723-L727); 2.28 does not.
    ("2.29.0", 1, None, {"logical_nc_config": 1}, "override=trn1"),
    ("2.28.0", 1, None, {"logical_nc_config": 1}, "override=None"),
    # Unset on a device-less host the platform is unknown (unverified in the real SDK: the double refuses).
    ("2.29.0", 0, None, {"logical_nc_config": 1}, "raised RuntimeError: TEST DOUBLE: no Neuron device"),
]


@pytest.fixture(scope="module")
def neuron_config_probe() -> Callable[[str, int, str | None, dict[str, Any]], str]:
    """What the double's NeuronConfig prints for one case: ``_PROBE`` runs once per release (each run imports
    torch) for all of that release's cases, each in the environment ``neuron_double_env`` gives it. The double
    reads its environment when called (``_release.current``, ``detected_platform``), and the probe restores the
    whole environment before each case, so a case sees what a process of its own would."""
    outputs: dict[str, dict[str, str]] = {}

    def case_id(devices: int, override: str | None, kwargs: dict[str, Any]) -> str:
        return json.dumps([devices, override, kwargs], sort_keys=True)

    def probe(release: str, devices: int, override: str | None, kwargs: dict[str, Any]) -> str:
        if release not in outputs:
            cases, common = [], neuron_double_env(sdk=release, devices=0)
            for r, d, o, k, _ in _RELEASE_CASES + _OVERRIDE_CASES:
                if r != release:
                    continue
                env = neuron_double_env(sdk=release, devices=d)
                assert env["PYTHONPATH"] == common["PYTHONPATH"]  # one release, one installed set of packages
                env.pop("NEURON_PLATFORM_TARGET_OVERRIDE", None)
                if o is not None:
                    env["NEURON_PLATFORM_TARGET_OVERRIDE"] = o
                cases.append({"id": case_id(d, o, k), "env": env, "kwargs": k})
            out = subprocess.run([PYTHON, "-c", _PROBE, json.dumps(cases)], env=common, capture_output=True,
                                 text=True)
            parts = re.split(r"^--- case (.*)\n", out.stdout, flags=re.M)
            outputs[release] = dict(zip(parts[1::2], parts[2::2], strict=True))
            assert len(outputs[release]) == len(cases), out.stdout + out.stderr
        return outputs[release][case_id(devices, override, kwargs)]

    return probe


@pytest.mark.parametrize(("release", "devices", "override", "kwargs", "expected"), _RELEASE_CASES)
def test_the_double_has_each_releases_neuron_config(
        neuron_config_probe: Callable[..., str], release: str, devices: int, override: str | None,
        kwargs: dict[str, Any], expected: str) -> None:
    out = neuron_config_probe(release, devices, override, kwargs)
    assert expected in out, out


@pytest.mark.parametrize(("release", "devices", "override", "kwargs", "expected"), _OVERRIDE_CASES)
def test_nxdi_2_29_sets_the_platform_override_itself(
        neuron_config_probe: Callable[..., str], release: str, devices: int, override: str | None,
        kwargs: dict[str, Any], expected: str) -> None:
    out = neuron_config_probe(release, devices, override, kwargs)
    assert expected in out, out


MIXTRAL = "neuronx_distributed_inference.models.mixtral.modeling_mixtral:NeuronMixtralForCausalLM"
LLAMA4_TEXT = "neuronx_distributed_inference.models.llama4.modeling_llama4_text:NeuronLlama4TextForCausalLM"


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory, checkpoints: dict[str, Path]) -> Path:
    """The tiny Llama checkpoint with the MoE attributes Mixtral's and Llama4's configs require."""
    moe = tmp_path_factory.mktemp("moe")
    for item in checkpoints["base"].iterdir():
        (moe / item.name).symlink_to(item)
    (moe / "config.json").unlink()
    config = json.loads((checkpoints["base"] / "config.json").read_text())
    (moe / "config.json").write_text(json.dumps({**config, "num_local_experts": 4, "num_experts_per_tok": 2}))
    return moe


@pytest.mark.parametrize("model", [MIXTRAL, LLAMA4_TEXT])
def test_moe_models_compile_with_their_own_neuron_config_class(tmp_path: Path, env: dict[str, str],
                                                              moe_checkpoint: Path, model: str) -> None:
    # NxDI's demo builds model_cls.get_neuron_config_cls() (NXDI@ef2731e inference_demo.py:L489); Mixtral's and
    # Llama4 text's is MoENeuronConfig (modeling_mixtral.py:L156-L158, modeling_llama4_text.py:L258-L260), whose
    # fields their MoE modules read (modules/moe_v2.py:L34-L79). The base NeuronConfig has none of them.
    run = _nxdi(tmp_path, "moe", env, moe_checkpoint, nxdi_model=model, capacity_factor=2.0, glu_mlp=True,
                router_config={"act_fn": "softmax"})
    assert run.returncode == 0, run.describe()
    saved = json.loads((run.out_dir / "neuron_config.json").read_text())["neuron_config"]
    assert saved["capacity_factor"] == 2.0 and saved["glu_mlp"] is True
    assert not any("Unexpected keyword arguments" in line for line in run.lines), run.describe()


def test_mixtral_with_glu_mlp_false_is_the_models_refusal(tmp_path: Path, env: dict[str, str],
                                                          moe_checkpoint: Path) -> None:
    # modeling_mixtral.py:L56 asserts glu_mlp is True while building: a configuration NxDI refuses, final.
    run = _nxdi(tmp_path, "moe", env, moe_checkpoint, nxdi_model=MIXTRAL, glu_mlp=False)
    assert run.returncode == 3, run.describe()
    assert run.result["code"] == "NXDI_CONFIG_ERROR" and "glu_mlp" in run.result["message"]


def test_a_config_nxdi_cannot_build_modules_from_is_a_service_bug_never_unknown(
        tmp_path: Path, env: dict[str, str], moe_checkpoint: Path) -> None:
    # blockwise_matmul_config given as a string (the spec's field table refuses it at submit: this is what gets
    # through if the service ever admits it): MoENeuronConfig keeps a non-dict as given (config.py:L837-L839) and
    # the MoE module reads .parallelize_token_to_block_mapping (modules/moe_v2.py:L77): AttributeError. The
    # service's bug: final (not retried as unknown), named so, with a line alerting can match.
    run = _nxdi(tmp_path, "moe", env, moe_checkpoint, nxdi_model=MIXTRAL, blockwise_matmul_config="fast")
    assert run.returncode == 3, run.describe()
    assert run.result["code"] == "NXDI_SERVICE_BUG"
    assert "AttributeError" in run.result["message"] and "parallelize_token_to_block_mapping" in run.result["message"]
    assert any("SERVICE BUG" in line for line in run.lines)
    assert _outcome(run).error_class != "unknown"


QWEN2 = "neuronx_distributed_inference.models.qwen2.modeling_qwen2:NeuronQwen2ForCausalLM"


@pytest.mark.parametrize("model", [QWEN2, MIXTRAL])
def test_lnc_1_on_trn2_reaches_the_compiler_where_the_models_flags_omit_it(
        tmp_path: Path, env: dict[str, str], checkpoints: dict[str, Path], moe_checkpoint: Path, model: str) -> None:
    # Qwen2's and Mixtral's get_compiler_args are fixed strings without --lnc (NXDI@ef2731e modeling_qwen2.py
    # L237-L242, modeling_mixtral.py:L321-L330) and the child drops NEURON_LOGICAL_NC_CONFIG: before issue 41
    # neuronx-cc compiled at its trn2 default, 2, while NxD laid out for 1. The double records both.
    checkpoint = moe_checkpoint if model == MIXTRAL else checkpoints["base"]
    run = _nxdi(tmp_path, "lnc1", env, checkpoint, target="trn2", nxdi_model=model, logical_nc_config=1)
    assert run.returncode == 0, run.describe()
    for tag in ("context_encoding_model", "token_generation_model"):
        neff = _neff(run, tag)
        assert (neff["target"], neff["lnc"], neff["nxd_logical_nc_config"]) == ("trn2", "1", "1"), neff
        assert "--lnc=1" in neff["flags"].split() and neff["flags"].count("lnc") == 1, neff["flags"]


def test_a_model_whose_flags_name_the_lnc_is_left_alone(tmp_path: Path) -> None:
    from workers.backends.nxdi import with_lnc_flag

    class Model:
        def get_compiler_args(self) -> str | None:
            return self.flags  # type: ignore[attr-defined, no-any-return]

    patched = with_lnc_flag(Model, 1)
    for flags, expected in [(None, None), ("-O1 --lnc=2", "-O1 --lnc=2"), ("-O1 -lnc 2", "-O1 -lnc 2"),
                            ("--logical-nc-config 2 -O1", "--logical-nc-config 2 -O1"), ("-O1", "-O1 --lnc=1")]:
        model = patched()
        model.flags = flags
        assert model.get_compiler_args() == expected
    assert patched.__name__ == "Model" and issubclass(patched, Model)


def test_an_unbounded_quantize_clamp_bound_is_left_to_nxdis_default() -> None:
    from workers.backends.nxdi import nxdi_kwargs

    # Canonical null stands for NxDI's float("inf") default (NXDI@ef2731e models/config.py:L551); passed as None it
    # would defeat Llama's `quantize_clamp_bound == float("inf")` -> 1200 fallback (modeling_llama.py:L339-L345).
    assert "quantize_clamp_bound" not in nxdi_kwargs({"tp_degree": 8, "quantize_clamp_bound": None})
    assert nxdi_kwargs({"tp_degree": 8, "quantize_clamp_bound": 600.0})["quantize_clamp_bound"] == 600.0
