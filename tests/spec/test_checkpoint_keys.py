"""Keys of NxD Inference compiles (hf-checkpoint models): what of a checkpoint is key material, and the files a
checkpoint directory must hold (compilesvc.spec.checkpoint, compilesvc.spec.keys).

Tests marked ``needs_nxdi_toolchain`` key an nxdi spec, which needs the release table's NxDI versions
(``toolchain_material(sdk, "nxdi", tp)``); they are skipped until the table has them.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from compilesvc.spec import neuron_releases
from compilesvc.spec.checkpoint import (
    WEIGHT_FILES,
    CheckpointError,
    CheckpointMaterial,
    canonical_config,
    checkpoint_files,
    parse_config,
    weight_layouts,
)
from compilesvc.spec.keys import KEY_SCHEMA, compute_keys, explain, presharded
from compilesvc.spec.neuron_kinds import nxdi_targets
from compilesvc.spec.parsing import parse_spec
from tests.doubles import neuron_double_env
from tests.spec.test_keys import PROPERTY_SETTINGS, load_golden, needs_nxdi_toolchain

HEX = "5" * 64
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
          "_name_or_path": "/models/a", "transformers_version": "4.57.6"}


def nxdi_doc(**neuron_config: Any) -> dict[str, Any]:
    return {"model": {"uri": "s3://models/llama/", "format": "hf-checkpoint"}, "target": "trn2", "sdk": "2.29.0",
            "neuron_config": {"tp_degree": 8, "seq_len": 256, **neuron_config}}


def golden_case(prefix: str) -> dict[str, Any]:
    return next(c for c in load_golden()["cases"] if c["name"].startswith(prefix))


def golden_keys(prefix: str) -> Any:
    case = golden_case(prefix)
    return compute_keys(parse_spec(case["spec"]), model_sha256=case["model_sha256"], default_isa=case["isa"],
                        salt=case["salt"], checkpoint=CheckpointMaterial.from_json(case["checkpoint"]))


# --- the checkpoint's material --------------------------------------------------------------------------------


def test_canonical_config_drops_where_and_by_what_it_was_saved() -> None:
    assert canonical_config(CONFIG) == {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                        "hidden_size": 64, "num_hidden_layers": 2}
    assert canonical_config(CONFIG) == canonical_config({**CONFIG, "_name_or_path": "/elsewhere",
                                                         "transformers_version": "4.40.0"})


def test_config_json_must_be_a_bounded_json_object_naming_an_architecture() -> None:
    assert parse_config(json.dumps(CONFIG).encode(), "config.json") == CONFIG
    for data, says in [(b"{", "not valid JSON"), (b"[1]", "not a JSON object"),
                       (b'{"model_type": "llama"}', "names no architectures"),
                       (b" " * (4 * 1024**2 + 1), "larger than 4 MiB")]:
        with pytest.raises(CheckpointError, match=says):
            parse_config(data, "config.json")


def test_the_weight_layout_is_nxdis_and_an_index_brings_its_shards() -> None:
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}

    def read(name: str) -> bytes:
        assert name == "model.safetensors.index.json"
        return json.dumps(index).encode()

    sharded = ["config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
               "model-00002-of-00002.safetensors", "tokenizer.json"]
    assert checkpoint_files(sharded, read) == ["model.safetensors.index.json", "model-00001-of-00002.safetensors",
                                               "model-00002-of-00002.safetensors"]
    # NxDI tries model.safetensors before the pickle (modules/checkpoint.py:L36-L68).
    assert checkpoint_files(["config.json", "pytorch_model.bin", "model.safetensors"], read) == ["model.safetensors"]
    assert checkpoint_files(["config.json", "pytorch_model.bin"], read) == ["pytorch_model.bin"]
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        checkpoint_files(["model.safetensors"], read)
    with pytest.raises(CheckpointError, match=r"no weights beside it: NxD Inference reads one of model\.safetensors"):
        checkpoint_files(["config.json", "tokenizer.json"], read)
    with pytest.raises(CheckpointError, match="names shards the checkpoint lacks: model-00002-of-00002"):
        checkpoint_files(sharded[:3], read)


def test_the_diffusers_names_come_before_an_index_from_nxdi_0_4() -> None:
    # NXDI@ef2731e modules/checkpoint.py:L49-L64; NXDI@v0.1.0 modules/checkpoint.py:L39-L54 (no diffusers names).
    assert WEIGHT_FILES == ("model.safetensors", "diffusion_pytorch_model.safetensors", "model.safetensors.index.json",
                            "diffusion_pytorch_model.safetensors.index.json", "pytorch_model.bin",
                            "pytorch_model.bin.index.json")
    index = json.dumps({"weight_map": {"a": "model-00001-of-00001.safetensors"}}).encode()
    rogue = ["config.json", "model.safetensors.index.json", "model-00001-of-00001.safetensors",
             "diffusion_pytorch_model.safetensors"]
    assert checkpoint_files(rogue, lambda name: index) == ["diffusion_pytorch_model.safetensors"]
    assert checkpoint_files(rogue, lambda name: index, weight_layouts("0.4.7422")) == [
        "diffusion_pytorch_model.safetensors"]
    assert checkpoint_files(rogue, lambda name: index, weight_layouts("0.3.5591")) == [
        "model.safetensors.index.json", "model-00001-of-00001.safetensors"]
    assert checkpoint_files(["config.json", "diffusion_pytorch_model.safetensors.index.json",
                             "model-00001-of-00001.safetensors"], lambda name: index) == [
        "diffusion_pytorch_model.safetensors.index.json", "model-00001-of-00001.safetensors"]


@pytest.mark.parametrize("sdk", ["2.25.0", "2.29.0"])  # the double's oldest and newest NxDI (0.5, 0.9)
def test_the_double_reads_the_file_the_key_hashes(tmp_path: Path, sdk: str) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(1)}, str(tmp_path / "diffusion_pytorch_model.safetensors"))
    save_file({"w": torch.ones(1)}, str(tmp_path / "model-00001-of-00001.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}}))
    nxdi = neuron_releases.lookup(sdk).neuronx_distributed_inference
    hashed = checkpoint_files(["config.json", *(p.name for p in tmp_path.iterdir())],
                              lambda name: (tmp_path / name).read_bytes(), weight_layouts(nxdi))
    read = subprocess.run(
        [sys.executable, "-c", "import sys; from neuronx_distributed_inference.modules.checkpoint import "
         "load_state_dict; print(float(load_state_dict(sys.argv[1])['w'][0]))", str(tmp_path)],
        env=neuron_double_env(sdk=sdk), capture_output=True, text=True, check=True).stdout.strip()
    assert (hashed == ["diffusion_pytorch_model.safetensors"]) == (read == "0.0"), (hashed, read)
    assert read == "0.0"  # diffusion_pytorch_model.safetensors, before the index (both NxDI >= 0.4)


def test_an_nxdi_spec_cannot_be_keyed_without_its_checkpoint() -> None:
    spec = parse_spec(nxdi_doc(), extra_flags=None)
    with pytest.raises(ValueError, match=r"keyed by its config\.json"):
        compute_keys(spec, model_sha256=HEX, default_isa="x86_64-avx2")


# --- keys (the release table's NxDI versions) -----------------------------------------------------------------


@needs_nxdi_toolchain
def test_an_nxdi_key_is_one_compile_of_the_contracts_material() -> None:
    keys = golden_keys("trn2-nxdi-llama-tp8-shard-on-load (base)")
    assert [(b.position, b.inputs) for b in keys.buckets] == [(0, [])]
    material = keys.material
    assert set(material) == {"schema", "salt", "model", "toolchain", "neuron_config", "flags"}
    assert material["schema"] == KEY_SCHEMA == "compilesvc-key/5"
    assert material["model"]["format"] == "hf-checkpoint" and material["model"]["weights"] is None
    assert "_name_or_path" not in material["model"]["config"]
    assert "transformers_version" not in material["model"]["config"]
    toolchain = material["toolchain"]
    assert (toolchain["target"], toolchain["backend"], toolchain["tp_degree"], toolchain["lnc"]) == \
        ("trn2", "nxdi", 8, 2)
    assert toolchain["neuron"]["neuronx-cc"] == "2.24.5133.0"
    assert "neuronx-distributed-inference" in toolchain["neuron"]
    assert material["neuron_config"]["tp_degree"] == 8
    assert "neuron_config" in keys.components


@needs_nxdi_toolchain
def test_a_fine_tune_shares_the_key_of_its_base_when_weights_are_sharded_at_load() -> None:
    base = golden_keys("trn2-nxdi-llama-tp8-shard-on-load (base)")
    tune = golden_keys("trn2-nxdi-llama-tp8-shard-on-load (fine-tune")
    assert tune.key == base.key and tune.bucket_keys == base.bucket_keys


@needs_nxdi_toolchain
def test_pre_sharded_weights_are_in_the_key() -> None:
    base = golden_keys("trn2-nxdi-llama-tp8-presharded (base)")
    tune = golden_keys("trn2-nxdi-llama-tp8-presharded (fine-tune")
    assert base.material["model"]["weights"] == {"model.safetensors": "1" * 64}
    assert tune.key != base.key
    assert base.key != golden_keys("trn2-nxdi-llama-tp8-shard-on-load (base)").key
    spec = parse_spec(nxdi_doc(save_sharded_checkpoint=True))
    with pytest.raises(ValueError, match="save_sharded_checkpoint puts the weights in the artifact"):
        compute_keys(spec, model_sha256=HEX, default_isa="x86_64-avx2", checkpoint=CheckpointMaterial(CONFIG))


@needs_nxdi_toolchain
def test_neuron_config_and_config_json_changes_are_misses() -> None:
    base = golden_keys("trn2-nxdi-llama-tp8-shard-on-load (base)")
    tp16 = golden_keys("trn2-nxdi-llama-tp16")
    layers = golden_keys("trn2-nxdi-llama-4-layers")
    assert len({base.key, tp16.key, layers.key}) == 3
    assert tp16.components["neuron_config"] != base.components["neuron_config"]
    assert layers.components["model"] != base.components["model"]
    assert layers.components["neuron_config"] == base.components["neuron_config"]


@needs_nxdi_toolchain
def test_name_or_path_and_weight_digests_do_not_move_a_shard_on_load_key() -> None:
    spec = parse_spec(nxdi_doc())
    one = compute_keys(spec, model_sha256=HEX, default_isa="x86_64-avx2", checkpoint=CheckpointMaterial(CONFIG))
    other = compute_keys(spec, model_sha256="6" * 64, default_isa="aarch64-neon", checkpoint=CheckpointMaterial(
        {**CONFIG, "_name_or_path": "/tmp/x"}, {"model.safetensors": "7" * 64}))
    assert one.key == other.key


@needs_nxdi_toolchain
def test_explain_shows_the_neuron_config_and_the_model_config() -> None:
    text = "\n".join(explain(golden_keys("trn2-nxdi-llama-tp8-presharded (base)")))
    assert "neuron_config " in text and '"save_sharded_checkpoint": true' in text
    assert '"num_hidden_layers": 2' in text and "config.json without _name_or_path" in text
    assert "1 files' sha256 (save_sharded_checkpoint)" in text
    assert "bucket[0]" in text and "(one NxDI compile: every bucket)" in text


# --- properties of generated nxdi specs -------------------------------------------------------------------------

SHAS = st.text("0123456789abcdef", min_size=64, max_size=64)
NXDI_RELEASES = ["2.28.0", "2.29.0"]


@st.composite
def nxdi_cases(draw: st.DrawFn) -> dict[str, Any]:
    """A valid nxdi spec document with its checkpoint: what a user and pinning can vary."""
    neuron_config = {"tp_degree": draw(st.sampled_from([1, 2, 8])), "batch_size": draw(st.sampled_from([1, 2, 4])),
                     "seq_len": draw(st.sampled_from([128, 256, 1024]))}
    if draw(st.booleans()):
        neuron_config["save_sharded_checkpoint"] = draw(st.booleans())
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "num_hidden_layers": draw(st.integers(1, 8)), "hidden_size": draw(st.sampled_from([64, 128, 4096])),
              "rope_theta": draw(st.sampled_from([10000.0, 500000.0])),
              "_name_or_path": draw(st.text(max_size=20)), "transformers_version": draw(st.sampled_from(["4.45.0",
                                                                                                          "4.57.6"]))}
    names = draw(st.lists(st.sampled_from(["model-00001.safetensors", "model-00002.safetensors"]), unique=True,
                          min_size=1))
    sdk = draw(st.sampled_from(NXDI_RELEASES))
    return {"doc": {"model": {"uri": "s3://models/llama/", "format": "hf-checkpoint"},
                    # NxDI's own targets: 2.29.0's runs on Trn2 and newer only (neuron_kinds.nxdi_targets).
                    "target": draw(st.sampled_from(nxdi_targets(sdk))),
                    "sdk": sdk,
                    "neuron_config": neuron_config, "labels": draw(st.dictionaries(st.text(min_size=1, max_size=5),
                                                                                   st.text(max_size=5), max_size=2))},
            "config": config, "weights": {name: draw(SHAS) for name in ["model.safetensors.index.json", *names]},
            "sha": draw(SHAS), "salt": draw(st.sampled_from(["", "s1"]))}


def key_of_case(case: dict[str, Any]) -> Any:
    return compute_keys(parse_spec(case["doc"]), model_sha256=case["sha"], default_isa="x86_64-avx2",
                        salt=case["salt"], checkpoint=CheckpointMaterial(case["config"], case["weights"]))


def _with(case: dict[str, Any], where: str, name: str, value: Any) -> dict[str, Any]:
    changed = copy.deepcopy(case)
    target = changed["doc"]["neuron_config"] if where == "neuron_config" else changed[where]
    target[name] = value
    return changed


@needs_nxdi_toolchain
@PROPERTY_SETTINGS
@given(case=nxdi_cases(), data=st.data())
def test_generated_nxdi_keys_move_with_what_nxdi_compiles_and_nothing_else(case: dict[str, Any],
                                                                           data: st.DataObject) -> None:
    keys = key_of_case(case)
    assert keys.key == key_of_case(copy.deepcopy(case)).key and [b.inputs for b in keys.buckets] == [[]]
    pre = presharded(parse_spec(case["doc"]))
    harmless = [
        _with(case, "config", "_name_or_path", data.draw(st.text(max_size=20))),
        _with(case, "config", "transformers_version", "9.9.9"),
        {**case, "sha": data.draw(SHAS)},
        _with(case, "doc", "labels", {"team": data.draw(st.text(max_size=5))}),
    ]
    if not pre:
        harmless.append({**case, "weights": {"model.safetensors": data.draw(SHAS)}})
    for same in harmless:
        assert key_of_case(same).key == keys.key
    moving = [
        _with(case, "config", "num_hidden_layers", case["config"]["num_hidden_layers"] + 1),
        _with(case, "config", "rope_theta", case["config"]["rope_theta"] * 2),
        _with(case, "neuron_config", "seq_len", case["doc"]["neuron_config"]["seq_len"] * 2),
        _with(case, "neuron_config", "batch_size", case["doc"]["neuron_config"]["batch_size"] * 2),
        _with(case, "neuron_config", "save_sharded_checkpoint", not pre),
        {**case, "salt": case["salt"] + "x"},
    ]
    if pre:
        moving.append({**case, "weights": {**case["weights"], "model.safetensors.index.json": "f" * 64}})
    for other in moving:
        assert key_of_case(other).key != keys.key
