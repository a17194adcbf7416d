"""TEST DOUBLE of ``neuronx_distributed_inference.models.llama.modeling_llama``. Not the real SDK.

LlamaInferenceConfig's required attributes (NXDI@ef2731e src/neuronx_distributed_inference/models/llama/
modeling_llama.py:L270-L282; same list at v0.7.14366) and NeuronLlamaForCausalLM (L1192, get_config_cls
L1326-L1327), whose compiler flags are the wrapper's default (no get_compiler_args override).
"""

from __future__ import annotations

from neuronx_distributed_inference.models.config import InferenceConfig, NeuronConfig
from neuronx_distributed_inference.models.model_base import NeuronBaseForCausalLM


class LlamaInferenceConfig(InferenceConfig):
    def get_required_attributes(self) -> list[str]:
        return ["hidden_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "pad_token_id",
                "vocab_size", "max_position_embeddings", "rope_theta", "rms_norm_eps", "hidden_act"]

    @classmethod
    def get_neuron_config_cls(cls) -> type[NeuronConfig]:
        return NeuronConfig


class NeuronLlamaForCausalLM(NeuronBaseForCausalLM):
    @classmethod
    def get_config_cls(cls) -> type[InferenceConfig]:
        return LlamaInferenceConfig
