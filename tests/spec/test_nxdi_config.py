"""An hf-checkpoint spec's neuron_config is checked field by field against the NxD Inference release its SDK
ships (issue 29, deliverable 1): every bad input is a field error naming ``neuron_config.<path>`` (or the spec
field at fault), and the canonical form fills every default so that writing a default changes nothing.

NxDI itself would take most of these silently (unknown fields are only logged: aws-neuron/
neuronx-distributed-inference@ef2731e models/config.py:L639-L640) or fail hours into the compile.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from compilesvc.dispatch.routing import queue_name
from compilesvc.spec.neuron_kinds import NotShipped, device_requirement
from compilesvc.spec.neuron_releases import table
from compilesvc.spec.neuron_toolchain import toolchain_material
from compilesvc.spec.nxdi_config import NeuronConfigError, canonical_neuron_config
from compilesvc.spec.nxdi_fields import fields, nxdi_release
from compilesvc.spec.nxdi_models import (
    CheckpointConfigError,
    UnsupportedArchitecture,
    architecture_class,
    check_checkpoint_config,
    class_source,
    supported_architectures,
)
from compilesvc.spec.parsing import SpecError, parse_spec

URI = "blob:sha256:" + "ab" * 32


def llm(neuron_config: dict[str, Any] | None = None, **top: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"model": {"uri": URI, "format": "hf-checkpoint"}, "target": "trn2", "sdk": "2.29.1",
                           "neuron_config": {"tp_degree": 8, "batch_size": 4, "seq_len": 2048}}
    if neuron_config is not None:
        doc["neuron_config"] = {**doc["neuron_config"], **neuron_config}
    doc.update(top)
    return doc


def errors(doc: dict[str, Any]) -> list[dict[str, str]]:
    with pytest.raises(SpecError) as raised:
        parse_spec(doc)
    return raised.value.errors


BAD: list[tuple[str, dict[str, Any], str, str]] = [
    ("unknown field", llm({"foo_bar": 1}), "neuron_config.foo_bar", "unknown field"),
    ("misspelt, with a suggestion", llm({"tp_degre": 8}), "neuron_config.tp_degre", "did you mean 'tp_degree'?"),
    ("misspelt seq_len", llm({"seq_length": 4096}), "neuron_config.seq_length", "did you mean 'seq_len'?"),
    ("says NxDI only warns", llm({"batchsize": 2}), "neuron_config.batchsize", "Unexpected keyword arguments"),
    ("string for an int", llm({"batch_size": "4"}), "neuron_config.batch_size", "expected an integer, got '4'"),
    ("bool for an int", llm({"tp_degree": True}), "neuron_config.tp_degree", "expected an integer"),
    ("string for a bool", llm({"enable_bucketing": "yes"}), "neuron_config.enable_bucketing",
     "expected true or false"),
    ("zero batch", llm({"batch_size": 0}), "neuron_config.batch_size", "must be at least 1"),
    ("short-form bucket above seq_len", llm({"buckets": [128, 4096]}), "neuron_config.buckets[1]",
     "bucket 4096 is above seq_len/max_length 2048"),
    ("short form not a list", llm({"buckets": 128}), "neuron_config.buckets", "expected a non-empty list"),
    ("short form empty", llm({"buckets": []}), "neuron_config.buckets", "expected a non-empty list"),
    ("short-form item not an int", llm({"buckets": [128, "512"]}), "neuron_config.buckets[1]",
     "expected a sequence length"),
    ("short form with NxDI's lists", llm({"buckets": [128], "context_encoding_buckets": [128],
                                          "enable_bucketing": True}),
     "neuron_config.context_encoding_buckets", "either buckets"),
    ("short form with bucketing off", llm({"buckets": [128], "enable_bucketing": False}),
     "neuron_config.enable_bucketing", "contradicts buckets"),
    ("context bucket above max_context_length",
     llm({"enable_bucketing": True, "max_context_length": 1024, "context_encoding_buckets": [128, 2048]}),
     "neuron_config.context_encoding_buckets[1]", "Context bucket 2048 should be <= 1024"),
    ("token-generation bucket above max_length", llm({"enable_bucketing": True, "token_generation_buckets": [4096]}),
     "neuron_config.token_generation_buckets[0]", "Token generation bucket 4096 should be <= 2048"),
    ("lists without bucketing", llm({"context_encoding_buckets": [128]}), "neuron_config.context_encoding_buckets",
     "no effect without enable_bucketing"),
    ("max_context_length above seq_len", llm({"max_context_length": 4096}), "neuron_config.max_context_length",
     "cannot be more than max_length"),
    ("tp beyond inf2.48xlarge", llm({"tp_degree": 32}, target="inf2", sdk="2.28.1"), "neuron_config.tp_degree",
     "inf2.48xlarge, has 24 at logical_nc_config 1"),
    ("tp beyond trn2 at LNC 2", llm({"tp_degree": 128}), "neuron_config.tp_degree",
     "trn2.48xlarge, has 64 at logical_nc_config 2"),
    ("LNC 2 on inf2", llm({"logical_nc_config": 2}, target="inf2", sdk="2.28.1"), "neuron_config.logical_nc_config",
     "only 1"),
    ("LNC 3", llm({"logical_nc_config": 3}), "neuron_config.logical_nc_config", "expected 1 or 2"),
    ("bad dtype", llm({"torch_dtype": "int8"}), "neuron_config.torch_dtype", "'int8' is not a dtype NxDI"),
    ("fp8 before NxDI has it", llm({"torch_dtype": "float8_e4m3fn"}, sdk="2.27.1"), "neuron_config.torch_dtype",
     "expected one of float32, float16, bfloat16 ("),
    ("release without NxDI (2.32.0)", llm(sdk="2.32.0"), "compiler.backend",
     "Neuron SDK 2.32.0 ships no neuronx-distributed-inference"),
    ("release before NxDI (2.20.2)", llm(sdk="2.20.2", target="trn1"), "compiler.backend",
     "ships no neuronx-distributed-inference"),
    ("compiler.args given", llm(compiler={"args": ["-O2"]}), "compiler.args[0]",
     "builds the compiler's flags from neuron_config"),
    ("compiler.tp_degree given", llm(compiler={"tp_degree": 8}), "compiler.tp_degree", "neuron_config.tp_degree"),
    ("hf-checkpoint on cpu", llm(target="cpu", sdk="2.5.1"), "model.format", "not for cpu"),
    ("shape buckets given", llm(buckets=[{"batch_size": 1, "seq_len": 128}]), "buckets", "neuron_config.buckets"),
    ("no neuron_config", {**llm(), "neuron_config": None}, "neuron_config", "required for an hf-checkpoint"),
    ("quantized without a path", llm({"quantized": True}), "neuron_config.quantized_checkpoints_path",
     "quantized_checkpoints_path is required"),
    ("quantized path empty", llm({"quantized": True, "quantized_checkpoints_path": " "}),
     "neuron_config.quantized_checkpoints_path", "is empty"),
    ("quantized path a URL", llm({"quantized": True, "quantized_checkpoints_path": "s3://bucket/q.pt"}),
     "neuron_config.quantized_checkpoints_path", "is a URL (s3://…)"),
    ("quantized path with NUL", llm({"quantized": True, "quantized_checkpoints_path": "/data/q\x00.pt"}),
     "neuron_config.quantized_checkpoints_path", "NUL or control character"),
    ("quantized path overlong", llm({"quantized": True, "quantized_checkpoints_path": "/d/" * 1400}),
     "neuron_config.quantized_checkpoints_path", "beyond the 4095"),
    ("quantized path with a long name", llm({"quantized": True, "quantized_checkpoints_path": "/" + "q" * 256}),
     "neuron_config.quantized_checkpoints_path", "longer than 255 bytes"),
    ("quantized path escaping with ..", llm({"quantized": True, "quantized_checkpoints_path": "q/../../etc/q.pt"}),
     "neuron_config.quantized_checkpoints_path", "climbs out"),
    ("quantized path with ~", llm({"quantized": True, "quantized_checkpoints_path": "~/q.pt"}),
     "neuron_config.quantized_checkpoints_path", "does not expand it"),
    ("a bad path without quantized", llm({"quantized_checkpoints_path": "https://example.com/q"}),
     "neuron_config.quantized_checkpoints_path", "is a URL (https://…)"),
    ("tp not divisible by cp", llm({"cp_degree": 3}), "neuron_config.cp_degree",
     "TP Degree must be evenly divisible by CP Degree"),
    ("mlp cp without sequence parallel", llm({"mlp_cp_degree": 2}), "neuron_config.mlp_cp_degree",
     "requires Sequence Parallel"),
    ("DP without continuous batching", llm({"attention_dp_degree": 2}), "neuron_config.attention_dp_degree",
     "is_continuous_batching must be enabled"),
    # NeuronBaseForCausalLM raises "Chunked Prefill is not available in NxDI for now" from 2.28 (NXDI@ef2731e
    # models/model_base.py:L3054-L3055; cd3abf3 L3097): every hub model is one, so the spec is refused (issue 41).
    ("chunked prefill on a causal LM", llm({"chunked_prefill_config": {}, "batch_size": 1}),
     "neuron_config.chunked_prefill_config", "Chunked Prefill is not available in NxDI for now"),
    ("chunked prefill on a causal LM, 2.28", llm({"chunked_prefill_config": {}, "is_block_kv_layout": True},
                                                 sdk="2.28.0"),
     "neuron_config.chunked_prefill_config", "cd3abf3 models/model_base.py:L3097"),
    ("fused speculation without a draft", llm({"enable_fused_speculation": True, "speculation_length": 4}),
     "neuron_config.enable_fused_speculation", "needs a draft model"),
    ("EAGLE without a draft", llm({"enable_eagle_speculation": True, "speculation_length": 4}),
     "neuron_config.enable_eagle_speculation", "model_base.py:L1607-L1609"),
    ("DP over a tkg batch it does not divide", llm({"attention_dp_degree": 2, "is_continuous_batching": True,
                                                     "batch_size": 4, "tkg_batch_size": 3}),
     "neuron_config.attention_dp_degree", "tkg_batch_size 3 must be evenly divisible"),
    ("DP above CP", llm({"attention_dp_degree": 4, "cp_degree": 2, "is_continuous_batching": True}),
     "neuron_config.attention_dp_degree", "Running DP Degree > CP Degree"),
    ("bad cast_type", llm({"cast_type": "fp32"}), "neuron_config.cast_type", "must be one of config, as-declared"),
    ("nested field misspelt", llm({"on_device_sampling_config": {"top_kk": 5}}),
     "neuron_config.on_device_sampling_config.top_kk", "did you mean 'top_k'?"),
    ("a number beyond a float", llm({"quantize_clamp_bound": 10**400}), "neuron_config.quantize_clamp_bound",
     "digits) is beyond the largest number"),
    ("a nested number beyond a float", llm({"on_device_sampling_config": {"temperature": 10**400}}),
     "neuron_config.on_device_sampling_config.temperature", "digits) is beyond the largest number"),
    ("skip_sharding with save_sharded_checkpoint", llm({"save_sharded_checkpoint": True, "skip_sharding": True}),
     "neuron_config.skip_sharding", "yet NxDI's load() reads them with save_sharded_checkpoint"),
    ("skip_sharding in 2.22", llm({"skip_sharding": True, "save_sharded_checkpoint": False}, sdk="2.22.0"),
     "neuron_config.skip_sharding", "(in 2.22 whenever skip_sharding is set)"),
    ("quantized pre-sharding", llm({"quantized": True, "quantized_checkpoints_path": "/data/q",
                                    "save_sharded_checkpoint": True}), "neuron_config.quantized",
     "quantized with save_sharded_checkpoint is not supported"),
    ("quantized pre-sharding by 2.21's default", llm({"quantized": True, "quantized_checkpoints_path": "q"},
                                                     sdk="2.21.0"), "neuron_config.quantized",
     "set save_sharded_checkpoint false"),
    ("LoRA", llm({"lora_config": {"max_loras": 2}}), "neuron_config.lora_config", "LoRA is not supported yet"),
    ("nested field of the wrong type", llm({"on_device_sampling_config": {"top_p": "high"}}),
     "neuron_config.on_device_sampling_config.top_p", "expected a number"),
    ("a field only newer releases have", llm({"token_generation_batches": [1, 4]}, sdk="2.27.1"),
     "neuron_config.token_generation_batches", "exists in NxDI of Neuron SDK 2.28.0"),
    ("a field only 2.21 has", llm({"async": True}), "neuron_config.async",
     "exists in NxDI of Neuron SDK 2.21.0 to 2.21.1"),
    ("overrides_torch_dtype alone", llm({"overrides_torch_dtype": True}), "neuron_config.overrides_torch_dtype",
     "has no effect without torch_dtype"),
    ("another target in neuron_config", llm({"target": "inf2"}), "neuron_config.target", "differs from the spec's"),
    ("a bucket list of strings", llm({"enable_bucketing": True, "context_encoding_buckets": ["128"]}),
     "neuron_config.context_encoding_buckets[0]", "expected an integer"),
    ("trn3 before 2.29", llm(target="trn3", sdk="2.28.1"), "target", "does not support target trn3"),
    ("neuron_config for a traced model", {**llm(), "model": {"uri": URI, "format": "torchscript"},
                                          "buckets": [{"batch_size": 1, "seq_len": 8}]},
     "neuron_config", "applies only to hf-checkpoint models"),
]


@pytest.mark.parametrize(("doc", "field", "fragment"), [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_neuron_config_is_refused_naming_the_field(doc: dict[str, Any], field: str, fragment: str) -> None:
    [error] = errors(doc)
    assert error["field"] == field
    assert fragment in error["message"]


def test_the_bad_input_table_is_large_enough() -> None:
    assert len(BAD) >= 25  # issue 29, "Done when": a table test of at least 20 cases


# -- the canonical form ---------------------------------------------------------------------------------------

def canonical(raw: dict[str, Any], sdk: str = "2.29.1", target: str = "trn2") -> dict[str, Any]:
    return canonical_neuron_config(sdk, target, raw)


def test_every_default_is_filled_in() -> None:
    out = canonical({})
    names = set(fields("2.29.1", "NeuronConfig")) - {"buckets", "logical_neuron_cores"}
    assert set(out) == names
    assert out["seq_len"] == out["max_context_length"] == out["max_length"] == out["n_positions"] == 128
    assert out["batch_size"] == out["ctx_batch_size"] == out["tkg_batch_size"] == out["max_batch_size"] == 1
    assert (out["tp_degree"], out["world_size"], out["local_ranks_size"]) == (1, 1, 1)
    assert out["logical_nc_config"] == 2 and out["lm_head_pad"] is True  # trn2's platform LNC
    assert canonical({}, target="inf2")["logical_nc_config"] == 1
    # Without torch_dtype NxDI keeps the checkpoint's dtype: written as bfloat16 + overrides_torch_dtype false.
    assert (out["torch_dtype"], out["overrides_torch_dtype"]) == ("bfloat16", False)
    assert out["target"] == "trn2" and out["enable_bucketing"] is False
    assert out["context_encoding_buckets"] is None and out["save_sharded_checkpoint"] is False
    assert out["on_device_sampling_config"] is None and out["quantize_clamp_bound"] is None


def test_writing_a_default_is_the_same_as_omitting_it() -> None:
    written = {"seq_len": 128, "batch_size": 1, "logical_nc_config": 2, "max_context_length": 128,
               "enable_bucketing": False, "save_sharded_checkpoint": False, "target": "trn2", "cast_type": "config",
               "moe_tp_degree": 1, "ctx_batch_size": 1}
    assert canonical(written) == canonical({})
    assert canonical({"on_device_sampling_config": {"top_p": 1}}) == canonical(
        {"on_device_sampling_config": {"top_p": 1.0, "do_sample": False}})
    assert canonical({"moe_tp_degree": 2})["moe_tp_degree"] == 2  # a subclass field kept where not the default


def test_the_short_form_expands_to_nxdis_bucket_lists() -> None:
    out = canonical({"seq_len": 2048, "buckets": [2048, 128, 512, 512]})
    assert out["enable_bucketing"] is True
    assert out["context_encoding_buckets"] == out["token_generation_buckets"] == [128, 512, 2048]
    assert "buckets" not in out
    explicit = canonical({"seq_len": 2048, "enable_bucketing": True, "context_encoding_buckets": [512, 128, 2048],
                          "token_generation_buckets": [128, 512, 2048]})
    assert explicit == out
    # Context buckets stop at max_context_length; token generation runs to seq_len.
    split = canonical({"seq_len": 2048, "max_context_length": 512, "buckets": [128, 512, 2048]})
    assert (split["context_encoding_buckets"], split["token_generation_buckets"]) == ([128, 512], [128, 512, 2048])


def test_enable_bucketing_alone_is_the_lists_nxdi_would_generate() -> None:
    # generate_buckets(128, n) (NXDI@ef2731e modules/autobucketing.py:L8-L19): (128, 3000) -> ..., 2048, 3000.
    out = canonical({"seq_len": 3000, "enable_bucketing": True})
    assert out["context_encoding_buckets"] == out["token_generation_buckets"] == [128, 256, 512, 1024, 2048, 3000]
    assert canonical({"seq_len": 1400, "enable_bucketing": True})["token_generation_buckets"] == [128, 256, 512, 1400]
    assert out == canonical({"seq_len": 3000, "buckets": [128, 256, 512, 1024, 2048, 3000]})


@pytest.mark.parametrize("spelling", ["bf16", "bfloat16", "torch.bfloat16", "BF16"])
def test_dtype_spellings_share_one_canonical_form(spelling: str) -> None:
    out = canonical({"torch_dtype": spelling})
    assert out == canonical({"torch_dtype": "bfloat16"})
    assert (out["torch_dtype"], out["overrides_torch_dtype"]) == ("bfloat16", True)


def test_fields_differ_per_release() -> None:
    # save_sharded_checkpoint: True in 2.21-2.22 (v0.2.0 config.py:L218), False from 2.23 (v0.3.5591 L234).
    assert canonical({}, sdk="2.22.0")["save_sharded_checkpoint"] is True
    assert canonical({}, sdk="2.23.0")["save_sharded_checkpoint"] is False
    # token_generation_batches exists from 2.28 (cd3abf3 L204).
    assert canonical({"token_generation_batches": [1, 2], "batch_size": 2}, sdk="2.28.0")[
        "token_generation_batches"] == [1, 2]
    # 2.21 has logical_neuron_cores (default 1, even on trn2), not logical_nc_config.
    old = canonical({}, sdk="2.21.0")
    assert old["logical_neuron_cores"] == 1 and "logical_nc_config" not in old
    with pytest.raises(NeuronConfigError, match=r"exists in NxDI of Neuron SDK 2\.22\.0"):
        canonical({"logical_nc_config": 1}, sdk="2.21.0")
    # The deprecated alias is still read from 2.22 on, and resolved into logical_nc_config.
    assert canonical({"logical_neuron_cores": 1}) == canonical({"logical_nc_config": 1})
    # float8 dtypes from 2.28 (cd3abf3 config.py to_torch_dtype).
    assert canonical({"torch_dtype": "float8_e4m3fn"}, sdk="2.28.0")["torch_dtype"] == "float8_e4m3fn"


def test_releases_without_source_on_github_are_marked_assumed() -> None:
    assert nxdi_release("2.29.1").assumed is None and nxdi_release("2.29.1").ref == "ef2731e"
    for sdk in ("2.30.0", "2.31.0", "2.31.1"):
        rel = nxdi_release(sdk)
        assert rel.ref == "ef2731e" and rel.assumed is not None and "assumed = 2.29 source" in rel.assumed
    assert "0.7.14366" in (nxdi_release("2.27.1").assumed or "")
    with pytest.raises(NotShipped):
        nxdi_release("2.32.0")
    for label, entry in table().items():  # every release that ships NxDI has a table column
        if entry.neuronx_distributed_inference:
            assert fields(label, "NeuronConfig")["tp_degree"].default["value"] == 1


def test_a_largest_tp_that_fits_is_accepted() -> None:
    assert canonical({"tp_degree": 128, "logical_nc_config": 1})["tp_degree"] == 128
    assert canonical({"tp_degree": 24}, target="inf2")["world_size"] == 24


# -- the spec ---------------------------------------------------------------------------------------------------

def test_the_spec_carries_the_canonical_config_and_its_tp_degree() -> None:
    spec = parse_spec(llm({"buckets": [128, 2048]}))
    assert spec.backend == "nxdi" and spec.tp_degree == 8 and spec.compiler.tp_degree == 1
    assert spec.nxdi_config["context_encoding_buckets"] == [128, 2048]
    same = parse_spec(llm({"buckets": [2048, 128], "torch_dtype": "bfloat16", "overrides_torch_dtype": True,
                           "logical_nc_config": 2}))
    dtype = parse_spec(llm({"buckets": [128, 2048], "torch_dtype": "bf16"}))
    assert same.nxdi_config == dtype.nxdi_config
    assert parse_spec(llm({}, target="inf2", sdk="2.24.1")).nxdi_config["logical_nc_config"] == 1


def test_the_nxdi_kind_routes_needs_no_device_and_keys_the_toolchain() -> None:
    assert device_requirement("2.21.0", "nxdi", 8) is None  # ModelBuilder traces with cpu_backend=True
    assert queue_name("trn2", "2.27.1", "nxdi", tp_degree=8) == queue_name("trn2", "2.27.1", "nxdi")
    assert toolchain_material("2.29.1", "nxdi", 8) == {
        "neuronx-cc": "2.24.8799.0", "torch-neuronx": "2.9.0.2.13.26312", "libneuronxla": ["2.2.16408.0"],
        "neuronx-distributed": "0.18.27753", "neuronx-distributed-inference": "0.9.17334"}
    # 2.24.0 and 2.24.1 ship one NxDI toolchain: one queue.
    assert queue_name("inf2", "2.24.1", "nxdi") == "compile.inf2.2.24.0.nxdi"


def test_a_spec_is_not_changed_by_validation() -> None:
    doc = llm({"buckets": [512, 128], "on_device_sampling_config": {"top_k": 5}})
    before = copy.deepcopy(doc)
    parse_spec(doc)
    assert doc == before


# -- the model hub ----------------------------------------------------------------------------------------------

def test_the_hub_maps_architectures_to_nxdi_classes_per_release() -> None:
    assert architecture_class("2.21.0", ["LlamaForCausalLM"]) == (
        "neuronx_distributed_inference.models.llama.modeling_llama", "NeuronLlamaForCausalLM")
    assert architecture_class("2.29.1", ["MistralForCausalLM"])[1] == "NeuronMistralForCausalLM"
    assert architecture_class("2.24.0", ["Qwen2ForCausalLM"])[1] == "NeuronQwen2ForCausalLM"  # not in MODEL_TYPES
    assert "modeling_llama.py:L944" in class_source("2.21.0", "LlamaForCausalLM")
    assert "assumed" in class_source("2.31.1", "LlamaForCausalLM")
    assert supported_architectures("2.21.0") == ["DbrxForCausalLM", "LlamaForCausalLM", "MixtralForCausalLM",
                                                 "MllamaForConditionalGeneration"]


def test_an_unsupported_architecture_names_it_and_the_supported_list() -> None:
    with pytest.raises(UnsupportedArchitecture) as raised:
        architecture_class("2.28.1", ["MistralForCausalLM"])
    message = str(raised.value)
    assert "'MistralForCausalLM'" in message and "Neuron SDK 2.28.1" in message and "from Neuron SDK 2.29.0" in message
    assert "LlamaForCausalLM" in message and "Qwen3ForCausalLM" in message
    assert isinstance(raised.value, ValueError)
    with pytest.raises(UnsupportedArchitecture, match="not in the model hub"):
        architecture_class("2.29.1", ["BertForMaskedLM"])


@pytest.mark.parametrize(("config", "field", "fragment"), [
    ([], (), "JSON object"),
    ({"model_type": "llama"}, ("architectures",), "no \"architectures\""),
    ({"architectures": [], "model_type": "llama"}, ("architectures", 0), "must list the model's architecture"),
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, ("architectures", 0), "'GPT2LMHeadModel'"),
    ({"architectures": ["LlamaForCausalLM"]}, ("model_type",), "no \"model_type\""),
])
def test_checkpoint_config_checks(config: Any, field: tuple[Any, ...], fragment: str) -> None:
    with pytest.raises(CheckpointConfigError) as raised:
        check_checkpoint_config("2.29.1", config)
    assert raised.value.field == field and fragment in raised.value.message


def test_a_llama_checkpoint_config_passes() -> None:
    """Accepted by every release that ships NxDI (Llama is in each one's hub), unchanged, as NeuronLlamaForCausalLM;
    and each attribute the check reads is what makes it pass: without it, the same config is refused there."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "num_attention_heads": 4, "num_hidden_layers": 2}
    given = copy.deepcopy(config)
    releases = [sdk for sdk, entry in table().items() if entry.neuronx_distributed_inference is not None]
    assert "2.21.0" in releases and "2.29.1" in releases
    for sdk in releases:
        assert check_checkpoint_config(sdk, config) is None, sdk
        assert architecture_class(sdk, config["architectures"]) == (
            "neuronx_distributed_inference.models.llama.modeling_llama", "NeuronLlamaForCausalLM")
    assert config == given
    for name in ("architectures", "model_type"):
        with pytest.raises(CheckpointConfigError) as raised:
            check_checkpoint_config("2.29.1", {k: v for k, v in config.items() if k != name})
        assert raised.value.field == (name,)


def test_refusals_cite_the_line_of_the_release_that_makes_the_check() -> None:
    # The context-bucket assertion is config.py:L146 at v0.3.5591 (2.23) and L194 at ef2731e (2.29).
    for sdk, where in (("2.23.0", "@v0.3.5591 src/neuronx_distributed_inference/models/config.py:L146"),
                       ("2.29.1", "@ef2731e src/neuronx_distributed_inference/models/config.py:L194")):
        with pytest.raises(NeuronConfigError) as raised:
            canonical({"enable_bucketing": True, "context_encoding_buckets": [512]}, sdk=sdk)
        assert where in raised.value.message
    # max_context_length <= max_length is asserted from 2.25 (v0.5.9230 L144); before that it is our rule.
    with pytest.raises(NeuronConfigError, match="our rule"):
        canonical({"seq_len": 256, "max_context_length": 512}, sdk="2.21.0")
    with pytest.raises(NeuronConfigError, match=r"@v0\.5\.9230 .*config\.py:L144"):
        canonical({"seq_len": 256, "max_context_length": 512}, sdk="2.25.0")
    with pytest.raises(NeuronConfigError, match=r"@v0\.1\.0 .*config\.py:L14;"):
        canonical({"torch_dtype": "float8_e5m2"}, sdk="2.21.0")


def test_a_client_checks_neuron_config_for_a_release_it_knows_and_leaves_the_rest_to_the_service() -> None:
    """parse_spec(extra_flags=None) is how the CLI and ArtifactSet read a spec before sending it."""
    with pytest.raises(SpecError) as raised:
        parse_spec(llm({"tp_degre": 8}), limits=None, extra_flags=None)
    assert raised.value.errors[0]["field"] == "neuron_config.tp_degre"
    unknown = parse_spec(llm({"tp_degre": 8}, sdk="2.99.0"), limits=None, extra_flags=None)
    assert unknown.sdk == "2.99.0"  # the service, whose release table may be newer, decides
    with pytest.raises(SpecError) as raised:
        parse_spec(llm(sdk="2.99.0"))
    assert raised.value.errors[0]["field"] == "sdk"


def test_the_field_table_is_the_research_tables_data() -> None:
    """compilesvc/spec/nxdi_fields.json holds docs/research/nxdi_config_fields.md's table (made with Python's ast
    over NxDI's config.py at each ref): every field, release and line agrees."""
    import json
    import re
    from importlib import resources
    from pathlib import Path

    research = Path(__file__).resolve().parents[2] / "docs" / "research" / "nxdi_config_fields.md"
    data = json.loads(resources.files("compilesvc.spec").joinpath("nxdi_fields.json").read_text())
    columns = list(data["columns"])
    rows = 0
    for line in research.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| ") or len(cells) != 12 or "." not in cells[0] or cells[0] == "class.field":
            continue
        cls, name = cells[0].split(".", 1)
        defaults = data["classes"][cls][name]["defaults"]
        for column, cell in zip(columns, cells[1:], strict=True):
            if cell == "—":
                assert column not in defaults, (cls, name, column)
            else:
                found = re.fullmatch(r"`.*` L(\d+)", cell)
                assert found and defaults[column]["line"] == int(found.group(1)), (cls, name, column)
        rows += 1
    assert rows == sum(len(fields) for fields in data["classes"].values()) == 196


@pytest.mark.parametrize("path", ["/data/llama-q/model.pt", "quantized/model.pt", "./q/../q.pt"])
def test_a_local_quantized_checkpoints_path_is_kept_as_written(path: str) -> None:
    # NxDI opens it as given at load (application_base.py checkpoint_loader_fn): kept verbatim, not normalised.
    assert canonical({"tp_degree": 8, "batch_size": 4, "seq_len": 2048, "quantized": True,
                      "quantized_checkpoints_path": path})["quantized_checkpoints_path"] == path
