"""NxD Inference's compiled directory as its ``compile()`` writes it, for the fleet's tests (no NxDI here).

``neuron_config.json`` is ``json.dumps(to_dict(InferenceConfig), indent=2, sort_keys=True)`` plus a newline
(aws-neuron/neuronx-distributed-inference@ef2731e src/neuronx_distributed_inference/models/config.py:L936-L944):
the HF config's attributes at the top level (copied from ``AutoConfig.from_pretrained(path).to_dict()``,
utils/hf_adapter.py:L49-L76, so ``_name_or_path`` and ``transformers_version`` come along), then
InferenceConfig's own members ``neuron_config`` (every NeuronConfig attribute, derived ones included; torch dtypes
as strings, config.py:L62-L77), ``fused_spec_config`` and ``metadata`` (L861-L868), and ``num_cores_per_group``
(add_derived_config, L892). Values below are Llama-3.1-8B's config.json and NxDI 2.29's defaults
(docs/research/nxdi_config_fields.md), with the fields vLLM sets (upstreaming-to-vllm@dd417b3
neuronx_distributed.py:L603-L616).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256,
}


def neuron_config(**given: Any) -> dict[str, Any]:
    """A NeuronConfig as serialised, with NxDI's derivations (config.py 2.29: L94-L167, L361-L384)."""
    tp = given.pop("tp_degree", 8)
    batch = given.pop("batch_size", 4)
    seq_len = given.pop("seq_len", 2048)
    max_context = given.pop("max_context_length", seq_len)
    nc: dict[str, Any] = {
        "activation_quantization_type": None, "allow_input_truncation": False, "async_mode": False,
        "attn_block_tkg_nki_kernel_enabled": False, "attn_cls": "NeuronLlamaAttention", "attn_kernel_enabled": None,
        "attn_tkg_nki_kernel_enabled": False, "batch_size": batch,
        "buckets": [b for b in (128, 256, 512, 1024, 2048) if b < max_context] + [max_context],
        "cast_type": "config", "cc_pipeline_tiling_factor": 2, "chunked_prefill_config": None,
        "context_encoding_buckets": None, "cp_degree": 1, "ctx_batch_size": 1, "enable_bucketing": True,
        "enable_eagle_speculation": False, "enable_fused_speculation": False, "ep_degree": 1,
        "flash_decoding_enabled": False, "fused_qkv": False, "is_block_kv_layout": None, "is_chunked_prefill": False,
        "is_continuous_batching": True, "is_medusa": False, "is_prefix_caching": False, "kv_cache_batch_size": batch,
        "kv_cache_padding_size": 0, "kv_cache_quant": False, "local_ranks_size": tp, "logical_nc_config": 1,
        "lora_config": None, "max_batch_size": batch, "max_context_length": max_context, "max_length": seq_len,
        "max_new_tokens": seq_len - max_context, "n_active_tokens": seq_len, "n_positions": seq_len,
        "on_cpu": False, "on_device_sampling_config": {"deterministic": False, "do_sample": False, "dynamic": True,
                                                       "global_topk": 256, "on_device_sampling_config": True,
                                                       "temperature": 1.0, "top_k": 1, "top_p": 1.0},
        "output_logits": False, "overrides_torch_dtype": True, "pa_block_size": seq_len, "pa_num_blocks": batch,
        "padding_side": "right", "pp_degree": 1, "quantization_dtype": "int8",
        "quantization_type": "per_tensor_symmetric", "quantize_clamp_bound": float("inf"), "quantized": False,
        "quantized_checkpoints_path": None, "rpl_reduce_dtype": None, "save_sharded_checkpoint": False,
        "scratchpad_page_size": None, "seq_len": seq_len, "sequence_parallel_enabled": True, "skip_sharding": False,
        "spec_batch_size": batch, "speculation_length": 0, "start_rank_id": 0, "target": None,
        "tkg_batch_size": batch, "token_generation_buckets": None, "torch_dtype": "bfloat16", "tp_degree": tp,
        "vocab_parallel": False, "world_size": tp,
    }
    nc.update(given)
    return nc


def inference_config(name_or_path: str = "/tmp/compilesvc-work/checkpoint", hf: dict[str, Any] | None = None,
                     **neuron: Any) -> dict[str, Any]:
    document = {**(hf or LLAMA_31_8B), "_name_or_path": name_or_path, "transformers_version": "4.51.3",
                "attribute_map": {}, "fused_spec_config": None, "metadata": None, "num_cores_per_group": 1,
                "neuron_config": neuron_config(**neuron)}
    return document


def config_bytes(document: dict[str, Any]) -> bytes:
    """As ``InferenceConfig.to_json_file`` writes it (Python's json: ``Infinity`` for quantize_clamp_bound)."""
    return (json.dumps(document, indent=2, sort_keys=True) + "\n").encode()


def safetensors(tensors: dict[str, tuple[str, list[int], bytes]]) -> bytes:
    """A valid safetensors file: an 8-byte little-endian header length, the JSON header, the data."""
    header: dict[str, Any] = {}
    offset = 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"".join(data for _, _, data in tensors.values())


def shard(rank: int) -> bytes:
    return safetensors({"embed_tokens.weight": ("BF16", [4, 2], bytes([rank]) * 16),
                        "lm_head.weight": ("BF16", [4, 2], bytes([rank + 1]) * 16)})


def compiled_files(document: dict[str, Any], *, shards: int = 0) -> dict[str, tuple[str, bytes]]:
    """The compiled directory's files by path, with the roles of issue 29's contract."""
    files = {"model.pt": ("model", b"PK\x03\x04 torchscript archive of every submodel and bucket"),
             "neuron_config.json": ("aux", config_bytes(document))}
    for rank in range(shards):
        files[f"weights/tp{rank}_sharded_checkpoint.safetensors"] = ("weights-shard", shard(rank))
    return files


def write_compiled(directory: Path, files: dict[str, tuple[str, bytes]]) -> Path:
    for name, (_, data) in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)
    return directory


def write_checkpoint(directory: Path, hf: dict[str, Any] | None = None) -> Path:
    """An HF checkpoint directory as ``save_pretrained`` leaves it (config.json + model.safetensors)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf or LLAMA_31_8B, indent=2))
    (directory / "model.safetensors").write_bytes(safetensors({"model.embed_tokens.weight": ("BF16", [4, 2],
                                                                                            b"\x01" * 16)}))
    return directory
