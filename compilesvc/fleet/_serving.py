"""Handing an NxD Inference artifact to vLLM: the environment, the serving arguments that match it, and the
check vLLM does not make.

Why a check: with ``NEURON_COMPILED_ARTIFACTS`` set, vLLM builds the model from the artifact's own
neuron_config.json and compares nothing with its serving arguments (aws-neuron/upstreaming-to-vllm@dd417b3
vllm/model_executor/model_loader/neuronx_distributed.py:L166-L191; vllm-project/vllm-neuron@a5ef7c8
vllm_neuron/worker/neuronx_distributed_model_loader.py:L180-L226); a failed load (FileNotFoundError,
ValueError) compiles into that directory, on the serving host (L192-L203; vllm-neuron L189-L194, L234-L241).
Which comparison is an equality and which a bound is decided, and cited, per rule in :func:`check_serving`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compilesvc.fleet._llm import LLMArtifact
from compilesvc.fleet._serving_dir import CHECKPOINT_FILES, checkpoint_file, is_checkpoint

#: The V0 fork picks its Neuron framework from this (transformers-neuronx when only that is installed):
#: upstreaming-to-vllm@dd417b3 vllm/platforms/neuron.py:L117-L130. vllm-neuron ignores it (platform.py:L234-L252).
FRAMEWORK_ENV = {"VLLM_NEURON_FRAMEWORK": "neuronx-distributed-inference"}
ARTIFACTS_ENV = "NEURON_COMPILED_ARTIFACTS"

#: vLLM's --dtype → NxDI's torch_dtype (vllm-neuron vllm_neuron/worker/constants.py:L9-L19; same table in the
#: V0 fork neuronx_distributed.py:L39-L49). "auto" is resolved from the checkpoint's config (see _dtype).
DTYPES = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32", "float32": "float32"}


class ServingArgsError(ValueError):
    """A vLLM argument that cannot be read (a value that is not a number, JSON that does not parse)."""


@dataclass
class ServingArgs:
    """The vLLM serving arguments that meet the artifact (None: not given)."""

    model: str | None = None
    tensor_parallel_size: int | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    dtype: str | None = None
    block_size: int | None = None
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    num_speculative_tokens: int | None = None
    override_neuron_config: dict[str, Any] = field(default_factory=dict)


_INT = {"--tensor-parallel-size": "tensor_parallel_size", "-tp": "tensor_parallel_size",
        "--max-num-seqs": "max_num_seqs", "--max-model-len": "max_model_len", "--block-size": "block_size",
        "--num-speculative-tokens": "num_speculative_tokens"}
_FLAGS = {"--enable-prefix-caching": ("enable_prefix_caching", True),
          "--no-enable-prefix-caching": ("enable_prefix_caching", False),
          "--enable-chunked-prefill": ("enable_chunked_prefill", True),
          "--no-enable-chunked-prefill": ("enable_chunked_prefill", False)}
_VALUED = {*_INT, "--model", "--dtype", "--override-neuron-config", "--additional-config", "--speculative-config"}


def parse_vllm_args(argv: Sequence[str]) -> ServingArgs:
    """The arguments of ``vllm serve`` (or the OpenAI server's) that the check compares; others are ignored.
    ``--override-neuron-config`` (V0) and ``--additional-config '{"override_neuron_config": …}'`` (vllm-neuron,
    neuronx_distributed_model_loader.py:L689-L701) are both read; a leading positional is the model."""
    args = ServingArgs()
    items = list(argv)
    if items and items[0] == "serve":
        items = items[1:]
    i = 0
    while i < len(items):
        token = items[i]
        name, eq, value = token.partition("=")
        if name.startswith("--"):
            name = name.replace("_", "-")  # vLLM's parser takes --max_model_len for --max-model-len
        if token.startswith("-") and name in _FLAGS and not eq:
            attr, flag = _FLAGS[name]
            setattr(args, attr, flag)
            i += 1
            continue
        if token.startswith("-") and name in _VALUED:
            if not eq:
                if i + 1 >= len(items):
                    raise ServingArgsError(f"{name} needs a value")
                value = items[i + 1]
                i += 1
            _assign(args, name, value)
        elif not token.startswith("-") and args.model is None and i == 0:
            args.model = token
        i += 1
    return args


def _assign(args: ServingArgs, name: str, value: str) -> None:
    if name in _INT:
        try:
            number = _whole(value)
        except ValueError:
            raise ServingArgsError(f"{name} {value!r} is not a whole number") from None
        if number < 1:  # every one is a count or a size: 0 or less would only be compared, and mislead
            raise ServingArgsError(f"{name} {value!r} must be at least 1")
        setattr(args, _INT[name], number)
    elif name == "--model":
        args.model = value
    elif name == "--dtype":
        args.dtype = value
    elif name == "--override-neuron-config":
        args.override_neuron_config.update(_json_object(name, value))
    elif name == "--additional-config":
        overrides = _json_object(name, value).get("override_neuron_config") or {}
        if not isinstance(overrides, dict):
            raise ServingArgsError(f"{name}: override_neuron_config must be a JSON object")
        args.override_neuron_config.update(overrides)
    elif name == "--speculative-config":
        tokens = _json_object(name, value).get("num_speculative_tokens")
        if tokens is not None:
            _assign(args, "--num-speculative-tokens", str(tokens))


#: vLLM's human-readable integers (vllm/engine/arg_utils.py human_readable_int): "1k" is 1000 in every release,
#: "1K" 1024 until the SI/IEC change that also made "1M" 10**6 and added "1Ki"; only the unambiguous ones are read.
_SUFFIXES = {"k": 10**3, "K": 2**10, "Ki": 2**10}


def _whole(value: str) -> int:
    for suffix in ("Ki", "k", "K"):
        if value.endswith(suffix):
            return int(value[: -len(suffix)]) * _SUFFIXES[suffix]
    return int(value)


def _json_object(name: str, value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise ServingArgsError(f"{name} is not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise ServingArgsError(f"{name} must be a JSON object")
    return parsed


def vllm_environment(artifact: LLMArtifact) -> dict[str, str]:
    """What vLLM's Neuron path needs in its environment to load ``artifact`` instead of compiling."""
    return {ARTIFACTS_ENV: str(artifact.compiled_model_path), **FRAMEWORK_ENV}


def vllm_serving_args(artifact: LLMArtifact) -> list[str]:
    """The vLLM arguments that match the artifact, in the order ``vllm serve`` documents them."""
    nc = artifact.neuron_config
    out = ["--tensor-parallel-size", str(nc.get("tp_degree", 1)), "--max-num-seqs", str(_batch_size(nc)),
           "--max-model-len", str(_max_model_len(nc)), "--dtype", str(nc.get("torch_dtype", "bfloat16"))]
    if nc.get("is_prefix_caching"):
        out += ["--enable-prefix-caching", "--block-size", str(nc.get("pa_block_size", nc.get("seq_len")))]
    if nc.get("enable_fused_speculation"):
        # No spaces: the sh format's VLLM_SERVE_ARGS is word-split by the shell that expands it.
        out += ["--speculative-config", json.dumps({"num_speculative_tokens": nc.get("speculation_length", 0)},
                                                   separators=(",", ":"))]
    return out


def _batch_size(nc: Mapping[str, Any]) -> int:
    # ctx/tkg/max/kv_cache batch sizes default to batch_size (NXDI@ef2731e models/config.py:L161-L167), and vLLM
    # compiles with batch_size = max_num_seqs (V0 L601-L606): the bound is batch_size, the conservative one.
    return int(nc.get("batch_size") or 1)


def _max_model_len(nc: Mapping[str, Any]) -> int:
    seq_len = int(nc.get("seq_len") or 128)
    if nc.get("is_block_kv_layout") or nc.get("allow_input_truncation"):
        return seq_len
    return min(seq_len, int(nc.get("max_context_length") or seq_len))


def check_serving(artifact: LLMArtifact, args: ServingArgs) -> list[str]:
    """One line per way vLLM started with ``args`` would serve something other than ``artifact`` was compiled
    for, or compile on this (the serving) host; empty when they match."""
    nc = artifact.neuron_config
    problems: list[str] = []

    # Equality: vLLM builds NxDI's tp_degree from --tensor-parallel-size (V0 neuronx_distributed.py:L604;
    # vllm-neuron L752-L753) and runs one rank per core; the NEFFs are sharded for exactly tp_degree ranks.
    tp = args.tensor_parallel_size if args.tensor_parallel_size is not None else 1  # vLLM's default is 1
    if tp != int(nc.get("tp_degree", 1)):
        given = "--tensor-parallel-size " + str(tp) if args.tensor_parallel_size is not None else \
            "--tensor-parallel-size is not given (vLLM's default 1)"
        problems.append(f"{given} but the artifact was compiled for tp_degree {nc.get('tp_degree', 1)}")

    # Bound: vLLM hands out sequence ids 0..max_num_seqs-1 (vllm-neuron neuronx_distributed_model_runner.py:L136;
    # V0 neuron_worker.py:L101-L106, one block per sequence) and NxDI uses them as rows of a KV cache compiled
    # with batch_size rows; fewer sequences than rows are padded (NXDI@ef2731e model_wrapper.py:L1343-L1399).
    batch = _batch_size(nc)
    if args.max_num_seqs is None:
        problems.append(f"--max-num-seqs is not given: vLLM would pick its own default (32 with vllm-neuron, "
                        f"platform.py:L195-L197; 256 in V0); pass --max-num-seqs {batch}")
    elif args.max_num_seqs > batch:
        problems.append(f"--max-num-seqs {args.max_num_seqs} but the artifact was compiled for batch_size {batch} "
                        "(sequence ids beyond the compiled KV cache rows)")
    problems += _lengths(nc, args)
    problems += _dtype(artifact, args)
    problems += _blocks(nc, args)
    problems += _speculation(nc, args)
    problems += _overrides(nc, args)
    problems += check_loadable(artifact, args)
    problems += _model_config(artifact, args)
    return problems


def check_loadable(artifact: LLMArtifact, args: ServingArgs | None = None) -> list[str]:
    """What makes vLLM fail to load ``artifact`` on this host whatever its arguments (and then compile here):
    the weights not where NxDI reads them, a batch vLLM cannot drive. One line each; empty when loadable."""
    nc = artifact.neuron_config
    problems = []
    batch = _batch_size(nc)
    if batch > 1 and not nc.get("is_continuous_batching"):
        problems.append(f"the artifact has batch_size {batch} without is_continuous_batching, which vLLM's batching "
                        "needs (V0 neuronx_distributed.py:L610; vllm-neuron L764)")
    return problems + _weights(artifact, args or ServingArgs())


def _lengths(nc: Mapping[str, Any], args: ServingArgs) -> list[str]:
    seq_len = int(nc.get("seq_len") or 128)
    max_context = int(nc.get("max_context_length") or seq_len)
    if args.max_model_len is None:
        return [f"--max-model-len is not given: vLLM would take the model's max_position_embeddings; pass "
                f"--max-model-len {_max_model_len(nc)}"]
    problems = []
    block_kv = bool(nc.get("is_block_kv_layout"))
    # Block KV: vLLM pads each block table to max_model_len // block_size entries (vllm-neuron
    # neuronx_distributed_model_runner.py:L746-L751), a shape compiled from seq_len: equality.
    if block_kv and args.max_model_len != seq_len:
        problems.append(f"--max-model-len {args.max_model_len} but the artifact was compiled with a block KV cache "
                        f"for seq_len {seq_len} (block tables must be {seq_len} tokens wide)")
    # Bound: positions beyond seq_len have no KV cache slot and no token-generation bucket
    # (NXDI@ef2731e model_wrapper.py:L920 "Input len … exceeds largest bucket").
    elif args.max_model_len > seq_len:
        problems.append(f"--max-model-len {args.max_model_len} but the artifact was compiled for seq_len {seq_len}")
    # Bound: vLLM admits prompts up to max_model_len; a prompt longer than max_context_length is a ValueError in
    # NxDI's context encoding (model_wrapper.py:L766-L778) unless allow_input_truncation cuts it.
    elif (args.max_model_len > max_context and not nc.get("allow_input_truncation")
          and not args.enable_chunked_prefill):
        problems.append(f"--max-model-len {args.max_model_len} but the artifact's context encoding takes at most "
                        f"max_context_length {max_context} tokens (longer prompts fail in NxDI)")
    return problems


def _dtype(artifact: LLMArtifact, args: ServingArgs) -> list[str]:
    compiled = str(artifact.neuron_config.get("torch_dtype", "bfloat16"))
    given = args.dtype or "auto"
    if given == "auto":
        # vLLM resolves "auto" from the checkpoint config's torch_dtype (float32 checkpoints are cast by a rule
        # that changed across vLLM releases): only a float16/bfloat16 checkpoint is unambiguous.
        hf = artifact.hf_config.get("torch_dtype") or artifact.hf_config.get("dtype")
        resolved = DTYPES.get(str(hf)) if str(hf) in ("float16", "bfloat16") else None
        if resolved is None:
            return [f"--dtype is auto (or not given) and the checkpoint's torch_dtype is {hf}: vLLM's choice is "
                    f"not certain; pass --dtype {compiled}"]
        if resolved != compiled:
            return [f"--dtype auto resolves to the checkpoint's {resolved} but the artifact was compiled for "
                    f"torch_dtype {compiled}"]
        return []
    if given not in DTYPES:
        return [f"--dtype {given} is not a dtype vLLM's Neuron path maps (expected one of {', '.join(DTYPES)})"]
    if DTYPES[given] != compiled:
        return [f"--dtype {given} but the artifact was compiled for torch_dtype {compiled}"]
    return []


def _blocks(nc: Mapping[str, Any], args: ServingArgs) -> list[str]:
    problems = []
    prefix = bool(args.enable_prefix_caching)
    # Equality: prefix caching selects NxDI's block KV layout and prefix buckets (vllm-neuron L779-L782,
    # L837-L839); the compiled model takes block tables only if it was compiled so.
    if prefix != bool(nc.get("is_prefix_caching")):
        problems.append(f"--enable-prefix-caching is {'on' if prefix else 'off'} but the artifact was compiled with "
                        f"is_prefix_caching {bool(nc.get('is_prefix_caching'))}")
    if not nc.get("is_block_kv_layout"):
        return problems  # vLLM sets block_size = max_model_len itself (vllm-neuron platform.py:L203-L207)
    block = int(nc.get("pa_block_size") or nc.get("seq_len") or 128)
    if args.block_size is None or args.block_size != block:
        shown = f"--block-size {args.block_size}" if args.block_size is not None else "--block-size is not given"
        problems.append(f"{shown} but the artifact was compiled with a block KV cache of pa_block_size {block}")
    elif args.max_num_seqs is not None and args.max_model_len is not None and nc.get("pa_num_blocks") is not None:
        # Bound, as vllm-neuron checks its own derived config (neuronx_distributed_model_loader.py:L845-L859).
        needed = math.ceil(args.max_model_len / block) * args.max_num_seqs
        if int(nc["pa_num_blocks"]) < needed:
            problems.append(f"--max-model-len {args.max_model_len} and --max-num-seqs {args.max_num_seqs} need "
                            f"{needed} KV blocks but the artifact was compiled with pa_num_blocks "
                            f"{nc['pa_num_blocks']}")
    return problems


def _speculation(nc: Mapping[str, Any], args: ServingArgs) -> list[str]:
    # Equality: num_speculative_tokens becomes speculation_length with fused speculation (V0 L632-L634;
    # vllm-neuron L786-L789); the fused model is a different submodel set.
    fused = bool(nc.get("enable_fused_speculation"))
    length = int(nc.get("speculation_length") or 0)
    tokens = args.num_speculative_tokens or 0
    if fused and tokens != length:
        return [f"--num-speculative-tokens {tokens or 'is not given'} but the artifact was compiled with fused "
                f"speculation of speculation_length {length}"]
    if not fused and tokens:
        return [f"--num-speculative-tokens {tokens} but the artifact was compiled without fused speculation"]
    return []


def _overrides(nc: Mapping[str, Any], args: ServingArgs) -> list[str]:
    # The V0 fork setattr()s every override onto the loaded artifact's NeuronConfig (neuronx_distributed.py:
    # L183-L185), unchecked; vllm-neuron ignores them (L222-L226). Either way an override that differs from the
    # compiled value does not do what it says.
    return [f"--override-neuron-config sets {name}={json.dumps(value)} but the artifact was compiled with "
            f"{name}={json.dumps(nc.get(name))}"
            for name, value in sorted(args.override_neuron_config.items()) if nc.get(name) != value]


def _weights(artifact: LLMArtifact, args: ServingArgs) -> list[str]:
    nc = artifact.neuron_config
    if nc.get("quantized"):
        # Quantized weights come from quantized_checkpoints_path on the loading host (application_base.py:L637-L643).
        path = nc.get("quantized_checkpoints_path")
        if not path or not os.path.exists(str(path)):
            return [f"the artifact is quantized and reads its weights from quantized_checkpoints_path {path}, "
                    "which does not exist on this host"]
        return []
    if artifact.presharded:
        missing = artifact.missing_shards()
        if missing:  # load() opens each rank's file (application_base.py:L389-L399): FileNotFoundError → recompile
            return [f"the artifact was compiled with save_sharded_checkpoint but lacks {', '.join(missing)}: vLLM "
                    "would fail to load it and compile on this host"]
        return []
    # Shard on load: NxDI reads the HF checkpoint from _name_or_path if it exists on this host, else from the
    # compiled directory itself (application_base.py:L630-L635); neither holding one is a FileNotFoundError
    # (modules/checkpoint.py:L65-L68), and vLLM then compiles on this host. vLLM's --model is not consulted.
    stored = artifact.name_or_path
    source: Path | None = None
    if stored is not None and os.path.exists(stored):
        source = Path(stored)
        if not is_checkpoint(source):
            return [f"the artifact holds no weights and NxDI will read them from its _name_or_path {stored}, which "
                    f"exists on this host but is not a checkpoint ({' or '.join(CHECKPOINT_FILES)})"]
    else:
        linked = checkpoint_file(artifact.compiled_model_path)
        if linked is None:
            where = f"its _name_or_path {stored} does not exist on this host" if stored else "it names no checkpoint"
            return [f"the artifact holds no weights (save_sharded_checkpoint false) and {where}: NxDI would look "
                    f"for them in {artifact.compiled_model_path}, fail, and vLLM would compile on this host; give "
                    "serve-env --checkpoint CKPT --serving-dir DIR (docs/fleet.md)"]
        source = linked.resolve().parent  # the checkpoint a serving directory links to
    if args.model is not None and os.path.isdir(args.model) and not os.path.samefile(args.model, source):
        return [f"--model {args.model} but NxDI will load the weights from {source}"]
    return []


#: HF config attributes that make two checkpoints different models (vLLM reads its own copy from --model).
_IDENTITY = ("architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "intermediate_size", "vocab_size")


def _model_config(artifact: LLMArtifact, args: ServingArgs) -> list[str]:
    """vLLM takes the HF config (vocab size, architecture: its sampler and tokenizer) from --model, NxDI from the
    artifact (V0 neuronx_distributed.py:L163-L165 vs L182): a --model of another architecture serves garbage."""
    if args.model is None or not (Path(args.model) / "config.json").is_file():
        return []
    try:
        theirs = json.loads((Path(args.model) / "config.json").read_bytes())
    except (OSError, ValueError):
        return [f"--model {args.model}: its config.json cannot be read"]
    ours = artifact.hf_config
    return [f"--model {args.model} has {name} {json.dumps(theirs.get(name))} but the artifact was compiled for "
            f"{json.dumps(ours.get(name))}"
            for name in _IDENTITY if name in ours and name in theirs and theirs[name] != ours[name]]
