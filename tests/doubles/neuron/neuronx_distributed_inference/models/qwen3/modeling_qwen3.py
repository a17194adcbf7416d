"""TEST DOUBLE of ``neuronx_distributed_inference.models.qwen3.modeling_qwen3`` (from SDK 2.25). Not the real SDK.

Qwen3 uses the wrapper's default flags (no get_compiler_args override at NXDI@ef2731e); config as Llama's.
"""

from __future__ import annotations

from neuronx_distributed_inference.models.llama.modeling_llama import LlamaInferenceConfig, NeuronLlamaForCausalLM


class Qwen3InferenceConfig(LlamaInferenceConfig):
    pass


class NeuronQwen3ForCausalLM(NeuronLlamaForCausalLM):
    @classmethod
    def get_config_cls(cls) -> type[Qwen3InferenceConfig]:
        return Qwen3InferenceConfig
