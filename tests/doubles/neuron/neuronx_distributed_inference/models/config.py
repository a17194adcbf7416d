"""TEST DOUBLE of ``neuronx_distributed_inference.models.config``: NeuronConfig, InferenceConfig. Not the real SDK.

Refs: NXDI = aws-neuron/neuronx-distributed-inference; ``@ef2731e`` is SDK 2.29's source, the line numbers of
other releases are in ``_fields.py`` and docs/research/nxdi_config_fields.md. Mirrored:

- every keyword a release's ``NeuronConfig.__init__`` pops is accepted with its default (``_fields.FIELDS``);
  anything else is only logged, ``NeuronConfig init: Unexpected keyword arguments: {kwargs}``
  (NXDI@ef2731e src/neuronx_distributed_inference/models/config.py:L639-L640; v0.7.14366 L562-L563);
- ``to_torch_dtype`` and its ``AssertionError("Unsupported dtype: …")`` (config.py:L46-L55); torch_dtype given
  sets ``overrides_torch_dtype`` (L107-L116);
- the checks with NxDI's own texts and exception types: cast_type (L118-L120), max_context_length (L139),
  context/token-generation buckets (L189-L201), token_generation_batches (L203-L213), quantized (L216-L221),
  chunked prefill (L293-L317), CP/TP (L361-L375), DP (L702-L721);
- 2.29 only: constructing a NeuronConfig sets ``NEURON_PLATFORM_TARGET_OVERRIDE`` when unset (L723-L727; absent
  at cd3abf3 = 2.28 and v0.7.14366);
- logical_nc_config priority env > kwarg > deprecated logical_neuron_cores > platform (L729-L759, L1104-L1118);
- InferenceConfig: the model's required attributes (``Config must define [...]``, L904-L911), ``save`` writing
  ``neuron_config.json`` as ``json.dumps(to_dict(self), indent=2, sort_keys=True)`` (L23, L934-L944).
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import os
import warnings
from typing import Any

import torch
from _release import current, detected_platform

from neuronx_distributed_inference.models._fields import FIELDS

CONFIG_FILE = "neuron_config.json"
#: NXDI@ef2731e config.py:L37.
LONG_CONTEXT_SCRATCHPAD_PAGE_SIZE = 1024


def nxdi_minor() -> str:
    """The ``_fields.FIELDS`` column of the emulated release (0.10, SDK 2.30/2.31, is not on GitHub: as 0.9)."""
    major, minor = (current().nxdi or "0.9").split(".")[:2]
    key = f"{major}.{minor}"
    return key if key in FIELDS else "0.9"


def get_platform_target() -> str:
    """torch_neuronx.utils.get_platform_target as far as is known: the override, else the device's platform.

    With neither, the real function's behaviour is unverified (docs/research/nxdi.md, open question 4): the
    double refuses, so a caller that forgot the override on a device-less host is found by the tests."""
    platform = detected_platform()
    if platform is None:
        raise RuntimeError("TEST DOUBLE: no Neuron device and NEURON_PLATFORM_TARGET_OVERRIDE unset: the platform "
                           "target is unknown (the real get_platform_target's behaviour here is unverified)")
    return platform


def get_platform_lnc() -> int:
    """NXDI@ef2731e config.py:L1104-L1118: 2 on trn2/trn3, else 1."""
    return 2 if get_platform_target() in ("trn2", "trn3") else 1


def to_torch_dtype(dtype_str: str) -> torch.dtype:
    """NXDI@ef2731e config.py:L46-L55 (the same five names in every release since v0.1.0)."""
    dtype_mapping = {
        "float32": torch.float32,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "float8_e4m3fn": torch.float8_e4m3fn,
        "float8_e5m2": torch.float8_e5m2,
    }
    assert dtype_str in dtype_mapping, f"Unsupported dtype: {dtype_str}"
    return dtype_mapping[dtype_str]


def to_dict(obj: Any) -> Any:
    """NXDI@ef2731e config.py:L62-L77: classes as {__module__, __name__}, dtypes as their short name."""
    if type(obj) is dict:
        return {k: to_dict(v) for k, v in obj.items()}
    elif type(obj) is list:
        return [to_dict(v) for v in obj]
    elif inspect.isclass(obj):
        return {"__module__": obj.__module__, "__name__": obj.__name__}
    elif hasattr(obj, "__dict__"):
        return {k: to_dict(v) for k, v in obj.__dict__.items()}
    elif type(obj) is torch.dtype:
        return str(obj).split(".")[1]
    return obj


class IncompatibleConfigError(ValueError):
    """NXDI@ef2731e config.py:L80-L81."""


class OnDeviceSamplingConfig:
    """NXDI@ef2731e config.py:L1064-L1075 (fields and defaults; the 2.29 top_k_kernel default is platform-dependent,
    the double takes False as every release before)."""

    def __init__(self, **kwargs: Any) -> None:
        self.do_sample = kwargs.pop("do_sample", False)
        self.top_k = kwargs.pop("top_k", 1)
        self.top_p = kwargs.pop("top_p", 1.0)
        self.temperature = kwargs.pop("temperature", 1.0)
        self.dynamic = kwargs.pop("dynamic", False)
        self.deterministic = kwargs.pop("deterministic", False)
        self.global_topk = kwargs.pop("global_topk", 256)
        self.on_device_sampling_config = kwargs.pop("on_device_sampling_config", True)
        self.top_k_kernel_enabled = kwargs.pop("top_k_kernel_enabled", False)
        if nxdi_minor() >= "0.8":
            self.sampling_dp_degree = kwargs.pop("sampling_dp_degree", 1)


class ChunkedPrefillConfig:
    """NXDI@ef2731e config.py:L1078-L1093."""

    def __init__(self, **kwargs: Any) -> None:
        self.max_num_seqs = kwargs.pop("max_num_seqs", 0)
        self.tkg_model_enabled = kwargs.pop("tkg_model_enabled", True)
        self.kernel_q_tile_size = kwargs.pop("kernel_q_tile_size", 128)
        self.kernel_kv_tile_size = kwargs.pop("kernel_kv_tile_size", 1024)


class NeuronConfig:
    """Base config class for inference in NxD (the fields the double models; every other field of the release
    is kept with its default, see the module docstring)."""

    def __init__(self, **kwargs: Any) -> None:
        fields = FIELDS[nxdi_minor()]
        self.batch_size = kwargs.pop("batch_size", 1)
        self.padding_side = kwargs.pop("padding_side", "right")
        self.seq_len = kwargs.pop("seq_len", 128)
        self.n_active_tokens = kwargs.pop("n_active_tokens", self.seq_len)
        self.n_positions = kwargs.pop("n_positions", self.seq_len)
        # config.py:L107-L116: a given torch_dtype (str or dtype) wins over the HF config's (hf_adapter.py:L58-L67).
        if "torch_dtype" in kwargs:
            self.torch_dtype = kwargs.pop("torch_dtype")
            if isinstance(self.torch_dtype, str):
                self.torch_dtype = to_torch_dtype(self.torch_dtype)
            self.overrides_torch_dtype = kwargs.pop("overrides_torch_dtype", True)
        else:
            self.torch_dtype = torch.bfloat16
            self.overrides_torch_dtype = False
        if "cast_type" in fields:  # from 2.24
            self.cast_type = kwargs.pop("cast_type", "config")
            if self.cast_type not in ["config", "as-declared"]:
                raise ValueError("cast_type must be one of config, as-declared")
        for name in ("rpl_reduce_dtype", "attention_dtype"):  # L122-L130
            value = kwargs.pop(name, None)
            setattr(self, name, to_torch_dtype(value) if isinstance(value, str) else value)
        # L134-L139
        self.max_context_length = kwargs.pop("max_context_length", self.seq_len)
        self.max_new_tokens = kwargs.pop("max_new_tokens", self.seq_len - self.max_context_length)
        if self.max_new_tokens == 0:
            self.max_new_tokens = None
        self.max_length = kwargs.pop("max_length", self.seq_len)
        assert self.max_context_length <= self.max_length, "max_context_length cannot be more than max_length"
        # L161-L167
        self.ctx_batch_size = kwargs.pop("ctx_batch_size", self.batch_size)
        self.tkg_batch_size = kwargs.pop("tkg_batch_size", self.batch_size)
        self.max_batch_size = kwargs.pop("max_batch_size", self.batch_size)
        self.kv_cache_batch_size = kwargs.pop("kv_cache_batch_size", self.batch_size)
        self.spec_batch_size = kwargs.pop("spec_batch_size", self.batch_size)
        # L173-L177
        self.on_device_sampling_config = kwargs.pop("on_device_sampling_config", None)
        if type(self.on_device_sampling_config) is dict:
            self.on_device_sampling_config = OnDeviceSamplingConfig(**self.on_device_sampling_config)
        # L186-L201: buckets are sorted in place, then the largest is checked.
        self.enable_bucketing = kwargs.pop("enable_bucketing", False)
        self.buckets = kwargs.pop("buckets", [self.seq_len])
        self.context_encoding_buckets = kwargs.pop("context_encoding_buckets", None)
        self.token_generation_buckets = kwargs.pop("token_generation_buckets", None)
        if self.context_encoding_buckets is not None:
            self.context_encoding_buckets.sort()
            assert (self.context_encoding_buckets[-1] <= self.max_context_length
                    ), f"Context bucket {self.context_encoding_buckets[-1]} should be <= {self.max_context_length}"
        if self.token_generation_buckets is not None:
            self.token_generation_buckets.sort()
            assert (self.token_generation_buckets[-1] <= self.max_length
                    ), f"Token generation bucket {self.token_generation_buckets[-1]} should be <= {self.max_length}"
        if "token_generation_batches" in fields:  # L203-L213
            self.token_generation_batches = kwargs.pop("token_generation_batches", None)
            if self.token_generation_batches is not None:
                if not isinstance(self.token_generation_batches, list):
                    self.token_generation_batches = [self.token_generation_batches]
                self.token_generation_batches.sort()
                assert self.token_generation_batches[-1] <= self.tkg_batch_size, (
                    f"Token generation batch buckets {self.token_generation_batches} "
                    f"should be <= token generation batch size ({self.tkg_batch_size})")
        # L216-L221
        self.quantized = kwargs.pop("quantized", False)
        self.quantized_checkpoints_path = kwargs.pop("quantized_checkpoints_path", None)
        if self.quantized is True:
            assert self.quantized_checkpoints_path is not None, "quantized_checkpoints_path is required"
        # L279-L317: chunked prefill needs the block KV layout.
        self.is_block_kv_layout = kwargs.pop("is_block_kv_layout", False)
        self.chunked_prefill_config = kwargs.pop("chunked_prefill_config", None)
        if type(self.chunked_prefill_config) is dict:
            self.chunked_prefill_config = ChunkedPrefillConfig(**self.chunked_prefill_config)
        self.is_chunked_prefill = self.chunked_prefill_config is not None
        if self.is_chunked_prefill:
            assert self.is_block_kv_layout, ("is_block_kv_layout has to be true for chunked prefill"
                                             " because it depends on block KV")
        # L361-L392: the distributed config.
        self.tp_degree = kwargs.pop("tp_degree", 1)
        self.cp_degree = kwargs.pop("cp_degree", 1)
        self.pp_degree = kwargs.pop("pp_degree", 1)
        self.ep_degree = kwargs.pop("ep_degree", 1)
        self.attention_dp_degree = kwargs.pop("attention_dp_degree", 1)
        self.save_sharded_checkpoint = kwargs.pop("save_sharded_checkpoint", False)
        self.skip_sharding = kwargs.pop("skip_sharding", False)
        self.sequence_parallel_enabled = kwargs.pop("sequence_parallel_enabled", False)
        self.mlp_cp_degree = kwargs.pop("mlp_cp_degree", 1)
        if self.tp_degree % self.cp_degree != 0:
            raise ValueError("TP Degree must be evenly divisible by CP Degree")
        if self.mlp_cp_degree > 1 and not self.sequence_parallel_enabled:
            raise IncompatibleConfigError("Context Parallel for MLP requires Sequence Parallel to be enabled")
        self.world_size = kwargs.pop("world_size", None) or self.tp_degree * self.pp_degree * self.ep_degree
        self.start_rank_id = kwargs.pop("start_rank_id", 0)
        self.local_ranks_size = kwargs.pop("local_ranks_size", None) or self.world_size
        if nxdi_minor() >= "0.9":
            self._setup_kernel_target_platform()  # L418, L723-L727
        self.logical_nc_config = self._get_lnc(kwargs)  # L570
        self.lm_head_pad = kwargs.pop("lm_head_pad", self.logical_nc_config > 1)  # L573
        self.is_continuous_batching = kwargs.pop("is_continuous_batching", False)
        self.target = kwargs.pop("target", None)  # L590: only adds --target to the compiler flags
        self.cc_pipeline_tiling_factor = kwargs.pop("cc_pipeline_tiling_factor", 2)
        # L613-L621
        self.scratchpad_page_size = kwargs.pop("scratchpad_page_size", None)
        if self.max_context_length >= 32 * 1024 and self.scratchpad_page_size is None:
            self.scratchpad_page_size = LONG_CONTEXT_SCRATCHPAD_PAGE_SIZE
        # Every other field of the release: its literal default (the double does not model what it does).
        for name, (default, _line) in fields.items():
            if name in ("logical_neuron_cores", "logical_nc_config"):
                continue
            if name in kwargs:
                setattr(self, name, kwargs.pop(name))
            elif not hasattr(self, name):
                setattr(self, name, copy.deepcopy(default))
        if kwargs:  # L639-L640: not an error
            logging.warning(f"NeuronConfig init: Unexpected keyword arguments: {kwargs}")
        self.validate_attention_data_parallel(self.attention_dp_degree)

    def validate_attention_data_parallel(self, attention_dp_degree: int) -> None:
        """NXDI@ef2731e config.py:L702-L721 (the checks whose fields the double models)."""
        if self.tp_degree % attention_dp_degree != 0:
            raise ValueError("TP Degree must be evenly divisible by DP Degree")
        if self.tkg_batch_size % attention_dp_degree != 0:
            raise ValueError("Batch Size must be evenly divisible by DP Degree")
        if attention_dp_degree > 1 and not self.is_continuous_batching:
            raise ValueError("--is-continuous-batching must be enabled when running DP")

    def _setup_kernel_target_platform(self) -> None:
        if not os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE"):
            os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = get_platform_target()

    def _get_lnc(self, kwargs: dict[str, Any]) -> int:
        env_lnc = int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", -1))
        kwargs_lnc = -1
        if "logical_neuron_cores" in kwargs:
            warnings.warn("'logical_neuron_cores' is deprecated and replaced by 'logical_nc_config'. In a future "
                          "release, this attribute will be removed.", category=DeprecationWarning, stacklevel=2)
            kwargs_lnc = int(kwargs.pop("logical_neuron_cores"))
        if "logical_nc_config" in kwargs:
            kwargs_lnc = int(kwargs.pop("logical_nc_config"))
        if env_lnc != -1:
            return env_lnc
        if kwargs_lnc != -1:
            return kwargs_lnc
        return get_platform_lnc()


class BlockwiseMatmulConfig:
    """NxD's ``neuronx_distributed.modules.moe.moe_configs.BlockwiseMatmulConfig`` as NxDI's MoE modules read it
    (NXDI@ef2731e modules/moe_v2.py:L77: ``blockwise_matmul_config.parallelize_token_to_block_mapping``)."""

    def __init__(self, **kwargs: Any) -> None:
        self.parallelize_token_to_block_mapping = kwargs.pop("parallelize_token_to_block_mapping", True)
        for name, value in kwargs.items():
            setattr(self, name, value)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> BlockwiseMatmulConfig:
        return cls(**kwargs)


class RouterConfig:
    """NxD's ``RouterConfig`` as NxDI reads it (modules/moe_v2.py:L42-L43 ``router_config.dtype``/``act_fn``;
    llama4/modeling_llama4_text.py:L345-L346 sets both)."""

    def __init__(self, dtype: Any = "float32", act_fn: str = "softmax", **_: Any) -> None:
        self.dtype, self.act_fn = dtype, act_fn

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> RouterConfig:
        return cls()


class MoENeuronConfig(NeuronConfig):
    """NXDI@ef2731e config.py:L798-L846: ``capacity_factor`` and ``glu_mlp`` are named parameters (L805-L806),
    the other MoE fields popped (``blockwise_matmul_config`` into BlockwiseMatmulConfig L837-L839,
    ``router_config`` into RouterConfig L841-L845) before NeuronConfig's own fields (L846)."""

    def __init__(self, capacity_factor: float | None = None, glu_mlp: bool = True, **kwargs: Any) -> None:
        self.capacity_factor = float(capacity_factor) if capacity_factor is not None else None
        self.glu_mlp = glu_mlp
        for name, default in (("glu_type", "glu"), ("hidden_act_scaling_factor", 1.0), ("hidden_act_bias", 0.0),
                              ("early_expert_affinity_modulation", False), ("fused_shared_experts", False),
                              ("transpose_shared_experts_weights", False), ("moe_tp_degree", 1),
                              ("moe_ep_degree", 1), ("hybrid_sharding_config", None)):
            setattr(self, name, kwargs.pop(name, default))
        self.normalize_top_k_affinities = not kwargs.pop("disable_normalize_top_k_affinities", False)
        blockwise = kwargs.pop("blockwise_matmul_config", {})
        self.blockwise_matmul_config = (BlockwiseMatmulConfig.from_kwargs(**blockwise) if isinstance(blockwise, dict)
                                        else blockwise)
        router = kwargs.pop("router_config", None)
        self.router_config = RouterConfig(**router) if isinstance(router, dict) else RouterConfig.from_kwargs(**kwargs)
        super().__init__(**kwargs)


class InferenceConfig:
    """NXDI@ef2731e config.py:L850-L1010 (the parts compile uses)."""

    attribute_map: dict[str, str] = {}

    def __init__(self, neuron_config: NeuronConfig, fused_spec_config: Any = None, load_config: Any = None,
                 metadata: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.neuron_config = neuron_config
        self.fused_spec_config = fused_spec_config
        if load_config is not None:
            load_config(self)
        else:
            self.load_config()
        self.metadata = metadata
        for key, value in kwargs.items():
            setattr(self, key, value)
        self.add_derived_config()
        self.validate_config()

    def __setattr__(self, key: str, value: Any) -> None:
        if key in super().__getattribute__("attribute_map"):
            key = super().__getattribute__("attribute_map")[key]
        super().__setattr__(key, value)

    def __getattribute__(self, key: str) -> Any:
        if key != "attribute_map" and key in super().__getattribute__("attribute_map"):
            key = super().__getattribute__("attribute_map")[key]
        return super().__getattribute__(key)

    def add_derived_config(self) -> None:
        self.num_cores_per_group = 1

    def load_config(self) -> None:
        pass

    def get_required_attributes(self) -> list[str]:
        return []

    def validate_config(self) -> None:
        missing_attributes = [x for x in self.get_required_attributes() if not hasattr(self, x)]
        assert len(missing_attributes) == 0, f"Config must define {missing_attributes}"

    def save(self, model_path: str | os.PathLike[str]) -> None:
        if not os.path.exists(model_path):
            os.makedirs(model_path)
        with open(os.path.join(model_path, CONFIG_FILE), "w", encoding="utf-8") as writer:
            writer.write(self.to_json_string() + "\n")

    def to_json_string(self) -> str:
        return json.dumps(to_dict(self), indent=2, sort_keys=True)

    @classmethod
    def get_neuron_config_cls(cls) -> type[NeuronConfig]:
        return NeuronConfig
