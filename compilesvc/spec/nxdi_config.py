"""NxD Inference's NeuronConfig, as a spec gives it: checked field by field against the NxDI release the spec's SDK
release ships, and written out canonically (every default filled in) for the key and for the worker.

The fields, types and defaults per release are data (:mod:`compilesvc.spec.nxdi_fields`). NxDI itself refuses
almost nothing: an unknown or misspelt field is only logged ("NeuronConfig init: Unexpected keyword arguments",
aws-neuron/neuronx-distributed-inference@ef2731e src/neuronx_distributed_inference/models/config.py:L639-L640;
v0.1.0 L232-L233) and the compile goes on with the default, hours later. So this module refuses, naming the
field: unknown fields (with a did-you-mean), wrong types, the combinations NxDI asserts (cited per check), a
tp degree the target's largest instance cannot hold and an LNC the target does not have (our rules, said so).

Canonical form: every field of the release's NeuronConfig with its value or default (derived defaults such as
``max_context_length = seq_len`` resolved as config.py does), dtypes spelt as NxDI's ``to_torch_dtype`` names
them, the LNC resolved for the target, and the sequence buckets written out (:mod:`compilesvc.spec.nxdi_buckets`:
our short form ``buckets: [128, 512, 2048]`` expanded to ``enable_bucketing`` + ``context_encoding_buckets`` +
``token_generation_buckets``). A spec that writes a default
and one that omits it have the same canonical form.
"""

from __future__ import annotations

import difflib
import math
import posixpath
import re
from typing import Any

from compilesvc.spec.neuronx_cc_options import LNC_TARGETS, default_lnc
from compilesvc.spec.nxdi_buckets import SHORT_FORM as _SHORT_FORM
from compilesvc.spec.nxdi_buckets import expand_buckets
from compilesvc.spec.nxdi_fields import (
    REPO,
    TOP_CLASSES,
    Field,
    NeuronConfigError,
    NxdiRelease,
    fields,
    nxdi_check,
    nxdi_release,
    releases_with,
)

__all__ = ["NeuronConfigError", "canonical_neuron_config", "normalise_dtype", "resolved_lnc"]

#: NxDI columns whose NeuronBaseForCausalLM (every model of the hub) raises NotImplementedError("Chunked Prefill is
#: not available in NxDI for now") in __init__; absent from v0.7.14366 (2.27) and earlier.
CHUNKED_PREFILL_REFUSED = {"2.28": f"{REPO}@cd3abf3 models/model_base.py:L3097",
                           "2.29.0": f"{REPO}@c63afe0 models/model_base.py",
                           "2.29-v2": f"{REPO}@ef2731e models/model_base.py:L3054-L3055"}


#: torch dtypes NxDI's ``to_torch_dtype`` accepts, by release column (v0.1.0 config.py:L14-L21: float32,
#: float16, bfloat16; the float8 pair from cd3abf3 (2.28) config.py:L46-L55). ``torch.<name>`` and the short
#: names below are ours (the spellings people write; vLLM's ``--dtype`` takes bf16/fp16/fp32 too).
_DTYPES_BASE = ("float32", "float16", "bfloat16")
_DTYPES_FP8 = ("float8_e4m3fn", "float8_e5m2")
_FP8_COLUMNS = frozenset({"2.28", "2.29.0", "2.29-v2"})
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
#: The line of ``def to_torch_dtype`` in config.py at each ref (git grep at each ref of the NxDI repository).
_TO_TORCH_DTYPE = {"v0.1.0": 14, "v0.1.1": 14, "v0.2.0": 15, "v0.3.5591": 21, "v0.4.7422": 33, "v0.5.9230": 36,
                   "v0.6.10598": 36, "v0.7.14366": 45, "cd3abf3": 46, "c63afe0": 46, "ef2731e": 46}

#: NeuronCores (physical) of each target's largest single instance: inf2.48xlarge 24 (aws-neuron-sdk@81ce03a
#: archive/appnotes/torch-neuronx/torch-neuronx-dataparallel-app-note.rst:L39), trn1.32xlarge 32
#: (about-neuron/benchmarks/trn1/trn1-training-performance.rst:L35), trn2.48xlarge 128 (64 at LNC 2;
#: about-neuron/arch/neuron-features/logical-neuroncore-config.rst:L56, L90), a Trn3 server 16 Trainium3
#: devices x 8 cores (about-neuron/arch/neuron-hardware/trn3-arch.rst:L13, trainium3.rst:L10). NxDI does not
#: check tp_degree against the device at all (docs/research/nxdi.md §3): this is our rule.
INSTANCE_CORES: dict[str, tuple[str, int]] = {
    "inf2": ("inf2.48xlarge", 24), "trn1": ("trn1.32xlarge", 32), "trn2": ("trn2.48xlarge", 128),
    "trn3": ("a Trn3 server (16 Trainium3 devices)", 128),
}
#: Integer fields that must be at least 1 (NxDI divides by or allocates with them; a 0 fails deep in tracing).
_POSITIVE = frozenset({
    "batch_size", "seq_len", "n_active_tokens", "n_positions", "max_context_length", "max_length", "ctx_batch_size",
    "tkg_batch_size", "max_batch_size", "kv_cache_batch_size", "spec_batch_size", "tp_degree", "pp_degree",
    "ep_degree", "cp_degree", "mlp_cp_degree", "attention_dp_degree", "world_size", "local_ranks_size",
    "pa_num_blocks", "pa_block_size", "logical_nc_config", "logical_neuron_cores", "cc_pipeline_tiling_factor",
})


def normalise_dtype(value: Any, column: str) -> str | None:
    """NxDI's spelling of a dtype (``"bf16"``, ``"torch.bfloat16"`` -> ``"bfloat16"``), or None if not one."""
    if not isinstance(value, str):
        return None
    name = value.strip().lower().removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    allowed = _DTYPES_BASE + (_DTYPES_FP8 if column in _FP8_COLUMNS else ())
    return name if name in allowed else None


def _allowed_dtypes(column: str) -> str:
    return ", ".join(_DTYPES_BASE + (_DTYPES_FP8 if column in _FP8_COLUMNS else ()))


def _describe(kinds: tuple[str, ...], nullable: bool) -> str:
    words = {"int": "an integer", "bool": "true or false", "number": "a number", "str": "a string",
             "dtype": "a dtype name", "int_list": "a list of integers", "str_list": "a list of strings",
             "list": "a list", "object": "an object"}
    out = [words.get(k.split(":")[0], k) for k in kinds]
    return " or ".join(out + (["null"] if nullable else []))


def _check_value(path: tuple[str | int, ...], spec: Field, value: Any, rel: NxdiRelease) -> Any:
    """``value`` of ``spec`` checked and normalised (numbers -> float, dtypes -> NxDI's names)."""
    if value is None and spec.nullable:
        return None
    for kind in spec.kinds:
        base = kind.split(":")[0]
        if base == "any":
            return value
        if base == "bool" and isinstance(value, bool):
            return value
        if base == "int" and isinstance(value, int) and not isinstance(value, bool):
            return value
        if base == "number" and isinstance(value, (int, float)) and not isinstance(value, bool):
            try:  # JSON integers are unbounded: float(10**400) raises OverflowError
                number = float(value)
            except OverflowError:
                raise NeuronConfigError(path, f"{str(value)[:12]}... ({len(str(value))} digits) is beyond the "
                                        "largest number NxDI can hold (a 64-bit float)") from None
            if not math.isfinite(number):
                break
            return number
        if base == "str" and isinstance(value, str):
            return value
        if base == "dtype":
            dtype = normalise_dtype(value, rel.column)
            if dtype is not None:
                return dtype
            where = rel.cite(_TO_TORCH_DTYPE[rel.ref])
            raise NeuronConfigError(path, f"{value!r} is not a dtype NxDI {rel.version} accepts; expected one of "
                                    f"{_allowed_dtypes(rel.column)} (to_torch_dtype: {where}; 'bf16' and "
                                    "'torch.bfloat16' are read as bfloat16)")
        if base in ("int_list", "str_list", "list") and isinstance(value, list):
            item = {"int_list": int, "str_list": str}.get(base)
            for index, entry in enumerate(value):
                if item is not None and (not isinstance(entry, item) or isinstance(entry, bool)):
                    raise NeuronConfigError((*path, index), f"expected {'an integer' if item is int else 'a string'}"
                                            f", got {entry!r}")
            return list(value)
        if base == "object" and isinstance(value, dict):
            return value
    raise NeuronConfigError(path, f"expected {_describe(spec.kinds, spec.nullable)}, got {value!r}")


def _unknown(path: tuple[str | int, ...], name: str, known: list[str], rel: NxdiRelease, cls: str) -> NeuronConfigError:
    hint = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
    elsewhere = releases_with(cls, name)
    if elsewhere:
        why = (f"{cls}.{name} exists in NxDI of Neuron SDK {elsewhere[0]}"
               + (f" to {elsewhere[-1]}" if elsewhere[-1] != elsewhere[0] else "") + f", not in {rel.version}")
    else:
        why = f"{cls} of NxDI {rel.version} (Neuron SDK {rel.sdk}) has no field {name!r}"
    suggestion = f"; did you mean {hint[0]!r}?" if hint else ""
    return NeuronConfigError(path, f"unknown field: {why}{suggestion} (NxDI itself only logs 'NeuronConfig init: "
                             "Unexpected keyword arguments' and compiles with the default: aws-neuron/"
                             "neuronx-distributed-inference@ef2731e src/neuronx_distributed_inference/models/"
                             "config.py:L639-L640)")


def _default(spec: Field, values: dict[str, Any], target: str, lnc: int) -> Any:
    """``spec``'s default given the values resolved so far (config.py's expressions, for ``target``)."""
    default = spec.default
    if "value" in default:
        value = default["value"]
        return list(value) if isinstance(value, list) else dict(value) if isinstance(value, dict) else value
    if "from" in default:
        return values[default["from"]]
    expr = default["expr"]
    if spec.name == "max_new_tokens":  # self.seq_len - self.max_context_length
        return values["seq_len"] - values["max_context_length"]
    if spec.name == "lm_head_pad":  # self.logical_nc_config > 1
        return lnc > 1
    if spec.name == "scratchpad_page_size":  # 1024 when max_context_length >= 32K (ef2731e config.py:L613-L621)
        return 1024 if values["max_context_length"] >= 32 * 1024 else None
    if spec.name == "skip_warmup":  # v0.3.5591 config.py:L378: True on trn2
        return target == "trn2"
    if spec.name == "top_k_kernel_enabled":  # hardware(target) != TRN1; NxD maps inf2 and trn1 to TRN1
        return target not in ("inf2", "trn1")
    if spec.name == "attn_block_tkg_nki_kernel_cache_update":  # v0.3.5591 config.py:L303
        return values.get("attn_block_tkg_nki_kernel_enabled", False)
    raise AssertionError(f"no rule for the default {expr!r} of {spec.cls}.{spec.name}")  # pragma: no cover


def _resolve_lnc(raw: dict[str, Any], column: str, target: str, rel: NxdiRelease) -> int:
    """The logical NeuronCore config NxDI will use: ``logical_nc_config``, else the deprecated
    ``logical_neuron_cores``, else the platform's (2 on trn2/trn3, else 1) — NXDI@ef2731e config.py:L729-L759
    (``_get_lnc``; we never pass NEURON_LOGICAL_NC_CONFIG). 2.21 has only ``logical_neuron_cores``, default 1."""
    name = "logical_neuron_cores" if column in ("2.21.0", "2.21.1") else "logical_nc_config"
    given = raw.get("logical_nc_config", raw.get("logical_neuron_cores"))
    if given is None:
        return 1 if name == "logical_neuron_cores" else default_lnc(target)
    field = "logical_nc_config" if "logical_nc_config" in raw else "logical_neuron_cores"
    if isinstance(given, bool) or not isinstance(given, int) or given not in (1, 2):
        raise NeuronConfigError((field,), f"expected 1 or 2 (LNC can only be 1 or 2: aws-neuron-sdk about-neuron/"
                                f"arch/neuron-features/logical-neuroncore-config.rst:L14), got {given!r}")
    if given == 2 and target not in LNC_TARGETS:
        raise NeuronConfigError((field,), f"{target} has no logical NeuronCores: only 1 is possible there (LNC "
                                f"applies to {', '.join(sorted(LNC_TARGETS))} only)")
    return given


def canonical_neuron_config(sdk: str, target: str, raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` checked against ``sdk``'s NxDI release for ``target`` and completed with its defaults.

    Raises :class:`NeuronConfigError` naming the first bad field; :class:`~compilesvc.spec.neuron_releases.
    NotShipped` / ``UnknownRelease`` for a release without NxDI / not in the release table.
    """
    rel = nxdi_release(sdk)
    top = fields(sdk, "NeuronConfig")
    extra = {name: spec for cls in TOP_CLASSES[1:] for name, spec in fields(sdk, cls).items()}
    for name in raw:
        if name != _SHORT_FORM and name not in top and name not in extra:
            raise _unknown((name,), name, sorted({*top, *extra, _SHORT_FORM}), rel, "NeuronConfig")
    column = rel.column
    lnc = _resolve_lnc(raw, column, target, rel)
    checked: dict[str, Any] = {}
    for name, value in raw.items():
        if name == _SHORT_FORM:
            continue
        spec = top.get(name) or extra[name]
        checked[name] = _check_value((name,), spec, value, rel)
        if name in _POSITIVE and isinstance(checked[name], int) and checked[name] < 1:
            raise NeuronConfigError((name,), f"must be at least 1, got {checked[name]}")
        if spec.nested and isinstance(checked[name], dict):
            checked[name] = _nested(name, spec.nested, checked[name], sdk, target, rel)
    if "overrides_torch_dtype" in checked and "torch_dtype" not in checked:  # config.py:L107-L116
        raise NeuronConfigError(("overrides_torch_dtype",), "has no effect without torch_dtype: NxDI then keeps the "
                                "checkpoint's dtype (and only logs the field as unexpected)")
    if "target" in checked and checked["target"] not in (None, target):
        raise NeuronConfigError(("target",), f"{checked['target']!r} differs from the spec's target {target!r}: "
                                "NxDI passes it to the compiler as --target (models/model_wrapper.py:L138-L139); "
                                "leave it out")
    out = _fill(top, checked, raw, target, lnc, column)
    for name, spec in extra.items():  # subclass fields: only where they differ from the default
        if name in checked and checked[name] != _default(spec, out, target, lnc):
            out[name] = checked[name]
    expand_buckets(out, raw, rel)
    _check_combinations(out, rel, target)
    return dict(sorted(out.items()))


def _fill(top: dict[str, Field], checked: dict[str, Any], raw: dict[str, Any], target: str, lnc: int,
          column: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, spec in top.items():  # config.py order: a derived default's source comes first
        if name == _SHORT_FORM:
            continue  # NxDI's own list, [seq_len] by default: ours is expanded below instead
        if name == "logical_nc_config" or (name == "logical_neuron_cores" and column in ("2.21.0", "2.21.1")):
            out[name] = lnc
        elif name == "logical_neuron_cores":
            continue  # the deprecated alias (2.22+): resolved into logical_nc_config
        elif name == "torch_dtype":
            # Absent, NxDI keeps the checkpoint's dtype (overrides_torch_dtype False; utils/hf_adapter.py:L58-L67):
            # written out as bfloat16 + overrides_torch_dtype False, which NxDI reads the same way (L107-L116).
            out[name] = checked.get(name, "bfloat16")
        elif name == "overrides_torch_dtype":
            out[name] = checked.get(name, "torch_dtype" in checked)
        elif name == "target":
            out[name] = target
        elif name in checked:
            out[name] = checked[name]
        else:
            out[name] = _default(spec, out, target, lnc)
    if "world_size" in out and out["world_size"] is None:  # config.py:L382-L387 (v0.1.0 L185-L192)
        out["world_size"] = out["tp_degree"] * out["pp_degree"] * out["ep_degree"]
    if "local_ranks_size" in out and out["local_ranks_size"] is None:
        out["local_ranks_size"] = out["world_size"]
    return out


def _nested(name: str, cls: str, value: dict[str, Any], sdk: str, target: str, rel: NxdiRelease) -> dict[str, Any]:
    table = fields(sdk, cls)
    if not table:  # a nested class the table has no fields for (LoraServingConfig): passed as given
        return value
    out: dict[str, Any] = {}
    for key, item in value.items():
        if key not in table:
            raise _unknown((name, key), key, sorted(table), rel, cls)
        out[key] = _check_value((name, key), table[key], item, rel)
    for key, spec in table.items():
        if key not in out:
            out[key] = _default(spec, out, target, 1)
    return dict(sorted(out.items()))


def _check_combinations(out: dict[str, Any], rel: NxdiRelease, target: str) -> None:
    """The combinations NxDI asserts, each where the release's config.py asserts it (cited from the "checks" of
    the table, docs/research/nxdi_config_fields.md), and our own rules, said to be ours."""
    def refuse(path: str, message: str, fragment: str) -> None:
        where = nxdi_check(rel, fragment)
        if where is not None:
            raise NeuronConfigError((path,), f"{message} (NxDI refuses it: {where})")

    if out["max_context_length"] > out["max_length"]:  # ours where NxDI does not assert it (before 2.25)
        where = nxdi_check(rel, "max_context_length cannot be more than max_length")
        raise NeuronConfigError(("max_context_length",), f"max_context_length {out['max_context_length']} cannot be "
                                f"more than max_length {out['max_length']} ("
                                + (f"NxDI refuses it: {where})" if where else "our rule: the context-encoding model "
                                   "would outgrow the KV cache; NxDI asserts it from SDK 2.25.0)"))
    if out.get("quantized_checkpoints_path") is not None:
        _check_quantized_path(out["quantized_checkpoints_path"])
    if out["quantized"] and not out["quantized_checkpoints_path"]:
        refuse("quantized_checkpoints_path", "quantized_checkpoints_path is required when quantized is true",
               "quantized_checkpoints_path is required")
    if out["quantized"] and out["save_sharded_checkpoint"]:
        # Pre-sharding loads the weights from quantized_checkpoints_path instead of the checkpoint (NXDI@ef2731e
        # models/application_base.py:L637-L643): any path the worker can see, and bytes the key's digests (the
        # checkpoint's weight files) do not describe. Without pre-sharding the compile never opens it.
        raise NeuronConfigError(("quantized",), "quantized with save_sharded_checkpoint is not supported: the "
                                "compile would shard weights from quantized_checkpoints_path, outside the pinned "
                                "checkpoint; set save_sharded_checkpoint false (NxDI then reads the quantized "
                                "weights at load time, on the serving host)")
    if out.get("lora_config") is not None:
        raise NeuronConfigError(("lora_config",), "LoRA is not supported yet: its adapters are files outside the "
                                "pinned checkpoint (LoraServingConfig), which the key cannot describe")
    if out.get("skip_sharding") and (out["save_sharded_checkpoint"] or rel.column == "2.22"):
        # shard_weights writes nothing with skip_sharding (NXDI@ef2731e models/application_base.py:L246-L248;
        # v0.2.0 L159), yet load() reads weights/tp{rank}_sharded_checkpoint.safetensors whenever
        # save_sharded_checkpoint (ef2731e L389-L399; v0.3.5591 L260) or, in 2.22, either flag (v0.2.0 L252).
        raise NeuronConfigError(("skip_sharding",), "skip_sharding leaves weights/tp{rank}_sharded_checkpoint."
                                "safetensors unwritten, yet NxDI's load() reads them "
                                + ("(in 2.22 whenever skip_sharding is set)" if rel.column == "2.22" else
                                   "with save_sharded_checkpoint") + ": the artifact could not load (our rule: "
                                "this service makes no shards outside the compile); leave skip_sharding out")
    if out.get("cast_type", "config") not in ("config", "as-declared"):
        refuse("cast_type", f"cast_type must be one of config, as-declared, got {out['cast_type']!r}",
               "cast_type must be one of")
    if out.get("attention_dtype") not in (None, out["torch_dtype"]) and out.get("cast_type") != "as-declared":
        refuse("cast_type", "attention_dtype differs from torch_dtype: cast_type must be 'as-declared'",
               "attention dtype and torch dtype are different")
    if out["tp_degree"] % out.get("cp_degree", 1):
        refuse("cp_degree", f"TP Degree must be evenly divisible by CP Degree: tp_degree {out['tp_degree']}, "
               f"cp_degree {out['cp_degree']}", "TP Degree must be evenly divisible by CP Degree")
    if out.get("mlp_cp_degree", 1) > 1 and not out["sequence_parallel_enabled"]:
        refuse("mlp_cp_degree", "Context Parallel for MLP requires Sequence Parallel to be enabled: set "
               "sequence_parallel_enabled", "Context Parallel for MLP requires Sequence Parallel")
    dp = out.get("attention_dp_degree", 1)
    if dp > 1:
        if out["tp_degree"] % dp:
            refuse("attention_dp_degree", "TP Degree must be evenly divisible by DP Degree",
                   "TP Degree must be evenly divisible by DP Degree")
        # NXDI@ef2731e config.py:L700-L721 checks tkg_batch_size (the token-generation batch), not batch_size.
        if out.get("tkg_batch_size", out["batch_size"]) % dp:
            refuse("attention_dp_degree", f"tkg_batch_size {out.get('tkg_batch_size', out['batch_size'])} must be "
                   "evenly divisible by attention_dp_degree", "Batch Size must be evenly divisible by DP Degree")
        cp = out.get("cp_degree", 1)
        if cp > 1 and cp < dp:
            refuse("attention_dp_degree", "Running DP Degree > CP Degree is not supported when CP and DP is enabled",
                   "Running DP Degree > CP Degree is not supported")
        if cp > 1 and cp % dp:
            refuse("attention_dp_degree", "CP Degree % DP Degree should be 0 when CP and DP is enabled",
                   "CP Degree % DP Degree should be 0")
        if out.get("attn_block_tkg_nki_kernel_cache_update") and not out.get("kv_cache_update_with_kernel"):
            refuse("kv_cache_update_with_kernel", "kv_cache_update_with_kernel must be set to enable "
                   "attn_block_tkg_nki_kernel_cache_update when DP is used",
                   "kv_cache_update_with_kernel must be set to enable attn_block_tkg_nki_kernel_cache_update")
        if not out["is_continuous_batching"]:
            refuse("attention_dp_degree", "is_continuous_batching must be enabled when running DP",
                   "is-continuous-batching must be enabled when running DP")
    batches = out.get("token_generation_batches")
    if batches is not None:
        largest = max(batches) if isinstance(batches, list) and batches else batches
        if isinstance(largest, int) and largest > out["tkg_batch_size"]:
            refuse("token_generation_batches", f"Token generation batch buckets {batches} should be <= token "
                   f"generation batch size ({out['tkg_batch_size']})", "Token generation batch buckets")
    if out.get("ep_dispatch_cc_option") == "RS_AG" and out["tp_degree"] > out.get("tkg_batch_size", out["batch_size"]):
        refuse("ep_dispatch_cc_option", "EP Dispatch option RS_AG not supported when TP degree > batch size",
               "EP Dispatch option RS_AG not supported")
    if out.get("enable_fused_speculation") or out.get("enable_eagle_speculation"):
        # Our rule: fused (and EAGLE, which turns it on: config.py:L255-L256) speculation builds the draft model
        # from config.fused_spec_config (NXDI@ef2731e models/model_base.py:L1607-L1609), which a spec cannot give:
        # the compile would always fail.
        field = "enable_fused_speculation" if out.get("enable_fused_speculation") else "enable_eagle_speculation"
        raise NeuronConfigError((field,), f"{field} needs a draft model (NxDI's fused_spec_config), which a spec "
                                "cannot carry: NxDI builds the draft from it (models/model_base.py:L1607-L1609 at "
                                f"{REPO}@ef2731e) and the compile would fail")
    if (out.get("chunked_prefill_config") is not None or out.get("is_chunked_prefill")) \
            and rel.column in CHUNKED_PREFILL_REFUSED:
        raise NeuronConfigError(("chunked_prefill_config",), "chunked prefill is not available for causal LMs in "
                                f"this NxD Inference: NeuronBaseForCausalLM raises 'Chunked Prefill is not "
                                f"available in NxDI for now' ({CHUNKED_PREFILL_REFUSED[rel.column]})")
    if out.get("chunked_prefill_config") is not None or out.get("is_chunked_prefill"):
        if not out.get("is_block_kv_layout"):
            refuse("is_block_kv_layout", "is_block_kv_layout has to be true for chunked prefill because it depends "
                   "on block KV", "is_block_kv_layout has to be true for chunked prefill")
        if out["batch_size"] != 1:
            refuse("batch_size", "batch_size has to be 1 for chunked prefill: it concatenates all requests into one "
                   "long request", "batch_size has to be 1 for chunked prefill")
    if out.get("is_medusa") and out.get("async_mode", out.get("async")):
        refuse("is_medusa", "Medusa Decoding is not yet supported with async",
               "Medusa Decoding is not yet supported with async")
    instance, cores = INSTANCE_CORES[target]
    lnc = out.get("logical_nc_config", out.get("logical_neuron_cores", 1))
    if out["tp_degree"] > cores // lnc:
        raise NeuronConfigError(("tp_degree",), f"tp_degree {out['tp_degree']} needs {out['tp_degree']} logical "
                                f"NeuronCores; the largest {target} instance, {instance}, has {cores // lnc} at "
                                f"logical_nc_config {lnc} (our rule: NxDI does not check it, and would build a "
                                "model no single instance can load)")


#: Linux's PATH_MAX and NAME_MAX (<linux/limits.h>): a longer path or name fails every open with ENAMETOOLONG.
_PATH_MAX, _NAME_MAX = 4096, 255
_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def _check_quantized_path(value: str) -> None:
    """``quantized_checkpoints_path`` must be a file-system path the serving host can open as written.

    NxDI reads it in ``checkpoint_loader_fn`` (NXDI@ef2731e models/application_base.py:L637-L643; fcb5a86
    L635-L641): ``os.path.exists`` on the string as given, then the weights are loaded from it instead of the
    checkpoint. That runs at compile only when pre-sharding (refused with quantized, below), otherwise at
    ``load()`` on the serving host, which reads the path back from the artifact's neuron_config.json. NxDI checks
    nothing else ("TODO: Add validation for quantized_checkpoints_path", config.py at fcb5a86 L223), so a URL, a
    ``~`` (not expanded), a NUL (``ValueError: embedded null byte``) or an over-long path fail at load, hours
    later and on another host. Relative paths resolve against the serving process's working directory; one
    that climbs out of it with ``..`` is refused (our rule)."""
    def refuse(why: str) -> None:
        raise NeuronConfigError(("quantized_checkpoints_path",), f"quantized_checkpoints_path {why} (our rule: NxDI "
                                "reads it as a local path when the model loads, and checks nothing before)")

    if not value.strip():
        refuse("is empty: expected the local path of the quantized checkpoint")
    if "\0" in value or any(ord(c) < 32 or ord(c) == 127 for c in value):
        refuse("holds a NUL or control character: not a path a host can open")
    if _URL_RE.match(value):
        refuse(f"is a URL ({value.split('://', 1)[0]}://…): NxDI opens it with os.path, so it must be a local path on "
               "the serving host")
    if value.startswith("~"):
        refuse("starts with '~': NxDI does not expand it; write the absolute path")
    if len(value.encode("utf-8")) >= _PATH_MAX:
        refuse(f"is {len(value.encode('utf-8'))} bytes long: beyond the {_PATH_MAX - 1} a path may have")
    if any(len(part.encode("utf-8")) > _NAME_MAX for part in value.split("/")):
        refuse(f"has a name longer than {_NAME_MAX} bytes")
    if not posixpath.isabs(value) and posixpath.normpath(value).split("/")[0] == "..":
        refuse("climbs out of the serving process's working directory with '..'")


def resolved_lnc(canonical: dict[str, Any]) -> int:
    """The LNC of a canonical config (2.21 names it logical_neuron_cores)."""
    return int(canonical.get("logical_nc_config", canonical.get("logical_neuron_cores", 1)))
