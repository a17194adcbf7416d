"""TEST DOUBLE data: the keyword arguments ``NeuronConfig.__init__`` pops, per NxDI minor version, with the
default when it is a literal (None where the default is an expression: the double computes the ones it
models) and the line of ``src/neuronx_distributed_inference/models/config.py`` that pops it.

Read from docs/research/nxdi_config_fields.md (Python ``ast`` over config.py at each ref of
aws-neuron/neuronx-distributed-inference, :data:`REFS`; 0.10 (SDK 2.30/2.31) is not on GitHub and is assumed
equal to 0.9). A name not listed for a release is an unknown keyword there: only warned about (config.py
"NeuronConfig init: Unexpected keyword arguments").

Written as the oldest release's table (:data:`BASE`) and each later release's differences from the one before
(:data:`CHANGES`), each difference with its line at that release's ref; :data:`FIELDS` is built from them, every
release's table in config.py's order (by line).

compilesvc/spec/nxdi_fields.json holds the same facts for the service, and this module does not read it on
purpose: the double imitates NxDI's source, and the tests that hold the service's NeuronConfig handling against
the double would prove nothing if both read one table (a wrong row would agree with itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: A field's literal default (None: an expression, or None itself) and the line of config.py that pops it.
Row = tuple[object, int]

#: NxDI minor version -> the ref of aws-neuron/neuronx-distributed-inference its lines are read at.
REFS = {"0.5": "v0.5.9230", "0.6": "v0.6.10598", "0.7": "v0.7.14366", "0.8": "cd3abf3", "0.9": "ef2731e"}


@dataclass(frozen=True)
class Changes:
    """One release's config.py against the release before it; every line is this release's (:data:`REFS`)."""

    #: (field, n): from that field on, in the earlier release's order up to the next pair's field, each field is
    #: popped n lines further down (n < 0: up). Fields before the first pair keep their line.
    shifts: tuple[tuple[str, int], ...]
    #: fields this release pops for the first time
    added: dict[str, Row] = field(default_factory=dict)
    #: fields whose literal default or place changed (their whole new row; the shifts pass them over)
    changed: dict[str, Row] = field(default_factory=dict)
    #: fields this release no longer pops
    removed: tuple[str, ...] = ()


BASE_RELEASE = "0.5"
#: v0.5.9230 (SDK 2.25).
BASE: dict[str, Row] = {
    'batch_size': (1, 99),
    'padding_side': ('right', 100),
    'allow_input_truncation': (False, 101),
    'seq_len': (128, 103),
    'n_active_tokens': (None, 104),
    'n_positions': (None, 106),
    'on_cpu': (False, 107),
    'output_logits': (False, 108),
    'torch_dtype': (None, 113),
    'overrides_torch_dtype': (True, 118),
    'cast_type': ('config', 123),
    'rpl_reduce_dtype': (None, 127),
    'attention_dtype': (None, 131),
    'max_context_length': (None, 139),
    'max_new_tokens': (None, 140),
    'max_length': (None, 143),
    'vocab_parallel': (False, 147),
    'layer_boundary_markers': (False, 150),
    'fused_qkv': (False, 153),
    'sequence_parallel_enabled': (False, 154),
    'weight_gather_seq_len_threshold': (32768, 155),
    'attn_cls': ('NeuronLlamaAttention', 157),
    'ctx_batch_size': (None, 162),
    'tkg_batch_size': (None, 163),
    'max_batch_size': (None, 164),
    'is_continuous_batching': (False, 165),
    'kv_cache_batch_size': (None, 168),
    'kv_cache_padding_size': (0, 171),
    'on_device_sampling_config': (None, 174),
    'async_mode': (False, 181),
    'enable_bucketing': (False, 184),
    'buckets': (None, 185),
    'bucket_n_active_tokens': (False, 186),
    'context_encoding_buckets': (None, 187),
    'prefix_buckets': (None, 188),
    'token_generation_buckets': (None, 189),
    'quantized': (False, 202),
    'quantized_checkpoints_path': (None, 203),
    'quantization_type': ('per_tensor_symmetric', 208),
    'quantization_dtype': ('int8', 209),
    'modules_to_not_convert': (None, 211),
    'draft_model_modules_to_not_convert': (None, 212),
    'kv_cache_quant': (False, 216),
    'speculation_length': (0, 219),
    'spec_batch_size': (None, 220),
    'enable_fused_speculation': (False, 221),
    'enable_eagle_speculation': (False, 222),
    'is_eagle_draft': (False, 223),
    'enable_eagle_draft_input_norm': (False, 224),
    'token_tree_config': (None, 235),
    'is_medusa': (False, 239),
    'medusa_speculation_length': (0, 240),
    'num_medusa_heads': (0, 241),
    'medusa_tree': (None, 242),
    'is_block_kv_layout': (False, 248),
    'pa_num_blocks': (None, 249),
    'pa_block_size': (None, 250),
    'is_prefix_caching': (False, 253),
    'chunked_prefill_config': (None, 261),
    'lora_config': (None, 280),
    'tp_degree': (1, 285),
    'cp_degree': (1, 286),
    'attention_dp_degree': (1, 287),
    'pp_degree': (1, 288),
    'ep_degree': (1, 289),
    'save_sharded_checkpoint': (False, 290),
    'skip_sharding': (False, 291),
    'qk_layernorm': (False, 303),
    'world_size': (None, 305),
    'start_rank_id': (0, 309),
    'local_ranks_size': (None, 310),
    'flash_decoding_enabled': (False, 316),
    'disable_kv_cache_tiling': (False, 323),
    'k_cache_transposed': (False, 338),
    'attn_kernel_enabled': (None, 341),
    'qkv_kernel_enabled': (False, 342),
    'qkv_kernel_nbsd_layout': (False, 343),
    'mlp_kernel_enabled': (False, 344),
    'fused_rmsnorm_skip_gamma': (False, 345),
    'mlp_kernel_fuse_residual_add': (False, 346),
    'qkv_kernel_fuse_residual_add': (False, 347),
    'quantized_mlp_kernel_enabled': (False, 348),
    'activation_quantization_type': (None, 349),
    'attn_tkg_nki_kernel_enabled': (False, 354),
    'attn_tkg_builtin_kernel_enabled': (False, 355),
    'attn_block_tkg_nki_kernel_enabled': (False, 356),
    'attn_block_cte_nki_kernel_enabled': (False, 357),
    'attn_block_tkg_nki_kernel_cache_update': (False, 376),
    'rmsnorm_quantize_kernel_enabled': (False, 404),
    'quantize_clamp_bound': (None, 409),
    'moe_fused_nki_kernel_enabled': (None, 422),
    'router_topk_nki_kernel_enabled': (None, 423),
    'expert_mlp_nki_kernel_enabled': (None, 424),
    'shared_mlp_nki_kernel_enabled': (None, 425),
    'lm_head_pad': (None, 431),
    'lm_head_pad_alignment_size': (1, 432),
    'cc_pipeline_tiling_factor': (2, 439),
    'seq_len_threshold_for_cc_tiling': (16384, 440),
    'target': (None, 448),
    'enable_spill_reload_dge': (False, 451),
    'apply_seq_ids_mask': (False, 461),
    'skip_warmup': (False, 464),
    'scratchpad_page_size': (None, 473),
    'enable_output_completion_notifications': (False, 478),
    'logical_neuron_cores': (None, 501),
    'logical_nc_config': (None, 504),
}

#: Each later release, oldest first, against the one before it. No release so far removes a field or changes
#: a literal default; two move one (``changed``).
CHANGES: dict[str, Changes] = {
    "0.6": Changes(  # v0.6.10598 (SDK 2.26)
        shifts=(("batch_size", 4), ("layer_boundary_markers", 8), ("qk_layernorm", 6), ("qkv_kernel_enabled", 7),
                ("attn_tkg_nki_kernel_enabled", 10), ("rmsnorm_quantize_kernel_enabled", 14),
                ("logical_neuron_cores", 16)),
        added={
            'enable_cte_modular_flow': (False, 155),
            'strided_context_parallel_kernel_enabled': (False, 348),
            'attn_block_tkg_nki_kernel_cascaded_attention': (False, 387),
        },
    ),
    "0.7": Changes(  # v0.7.14366 (SDK 2.27)
        shifts=(("batch_size", -12), ("modules_to_not_convert", 0), ("is_eagle_draft", 1),
                ("chunked_prefill_config", 4), ("lora_config", 40), ("attention_dp_degree", 41), ("qk_layernorm", 40),
                ("world_size", 42), ("qkv_kernel_nbsd_layout", 47), ("fused_rmsnorm_skip_gamma", 48),
                ("activation_quantization_type", 49), ("rmsnorm_quantize_kernel_enabled", 60),
                ("logical_neuron_cores", 90)),
        added={
            'quantization_block_size': (None, 206),
            'quantization_block_axis': (None, 207),
            'quantization_scale_dtype': ('f32', 208),
            'is_mxfp4_compute': (False, 211),
            'is_full_model_shuffled': (False, 215),
            'is_eagle3': (False, 231),
            'windowed_context_encoding_size': (None, 265),
            'tensor_replacement_config': (None, 292),
            'tensor_capture_config': (None, 306),
            'mlp_cp_degree': (1, 335),
            'pre_rope_rmsnorm': (False, 351),
            'qkv_nki_kernel_enabled': (False, 392),
            'qkv_cte_nki_kernel_fuse_rope': (False, 393),
            'mlp_tkg_nki_kernel_enabled': (False, 399),
            'out_proj_kernel_enabled': (False, 404),
            'attn_block_tkg_nki_kernel_use_online_softmax': (True, 443),
            'padded_hidden_size': (None, 555),
            'padded_intermediate_size': (None, 556),
            'disable_numeric_cc_token': (False, 558),
            'switch_cc': (False, 560),
        },
    ),
    "0.8": Changes(  # cd3abf3 (SDK 2.28)
        shifts=(("batch_size", 3), ("async_mode", 6), ("quantized", 18), ("modules_to_not_convert", 16),
                ("is_eagle3", 17), ("token_tree_config", 20), ("tensor_replacement_config", 28),
                ("attn_tkg_nki_kernel_enabled", 32), ("rmsnorm_quantize_kernel_enabled", 33),
                ("apply_seq_ids_mask", 37), ("switch_cc", 39), ("logical_neuron_cores", 92)),
        added={
            'disable_argmax_kernel': (False, 180),
            'token_generation_batches': (None, 204),
            'eagle_rolling_buffer_kernel_enabled': (False, 247),
            'kv_quant_config': (None, 300),
            'attn_block_tkg_nki_kernel_disable_gpsimd_sb2sb': (False, 476),
            'weights_to_skip_layout_optimization': ([], 561),
            'dma_order_config': (None, 568),
            'ep_dispatch_cc_option': ('AR_AG', 602),
        },
        changed={
            'fused_qkv': (False, 437),  # moved after the kernel flags (v0.7.14366: L149)
        },
    ),
    "0.9": Changes(  # ef2731e (SDK 2.29, "sync code base to release-2.29-v2")
        shifts=(("qk_layernorm", 1), ("attn_kernel_enabled", 2), ("fused_rmsnorm_skip_gamma", 5),
                ("attn_block_tkg_nki_kernel_cache_update", 2), ("rmsnorm_quantize_kernel_enabled", 35),
                ("logical_neuron_cores", 41)),
        added={
            'enable_ve_data_parallel': (False, 369),
        },
        changed={
            # moved after the cascaded-attention flags (cd3abf3: L448)
            'attn_block_cte_nki_kernel_enabled': (False, 482),
        },
    ),
}


def _apply(before: dict[str, Row], changes: Changes) -> dict[str, Row]:
    """The table of the release ``changes`` describes, from the table of the release before it."""
    starts = dict(changes.shifts)
    unknown = (set(starts) | set(changes.changed) | set(changes.removed)) - set(before)
    if unknown or set(changes.added) & set(before):
        raise ValueError(f"changes name fields the release before lacks ({sorted(unknown)}) or already has "
                         f"({sorted(set(changes.added) & set(before))})")
    rows: dict[str, Row] = {}
    offset = 0
    for name, (default, line) in before.items():
        offset = starts.get(name, offset)
        if name not in changes.removed and name not in changes.changed:
            rows[name] = (default, line + offset)
    rows.update(changes.added)
    rows.update(changes.changed)
    if len({line for _default, line in rows.values()}) != len(rows):
        raise ValueError("two fields popped at one line: a shift is wrong")
    return dict(sorted(rows.items(), key=lambda item: item[1][1]))


def _tables() -> dict[str, dict[str, Row]]:
    tables = {BASE_RELEASE: BASE}
    for release, changes in CHANGES.items():
        tables[release] = _apply(list(tables.values())[-1], changes)
    return tables


#: NxDI minor version -> field -> (literal default, config.py line at :data:`REFS`), in config.py's order.
FIELDS: dict[str, dict[str, Row]] = _tables()
