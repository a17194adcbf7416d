"""TEST DOUBLE of ``neuronx_distributed_inference.models.llama4.modeling_llama4_text``. Not the real SDK.

Llama4's text model (HF ``Llama4ForCausalLM``): its InferenceConfig (NXDI@ef2731e models/llama4/
modeling_llama4_text.py:L203) builds MoENeuronConfig (``get_neuron_config_cls``, L258-L260), and its MoE decoder
layer sets ``config.neuron_config.router_config.dtype``/``act_fn`` before building the MoE module (L338-L352).
With the base NeuronConfig, which has no ``router_config``, that is an AttributeError, as in NxDI. The compiler
flags are the wrapper's default here (the double does not model Llama4's own).
"""

from __future__ import annotations

from neuronx_distributed_inference.models.config import MoENeuronConfig, NeuronConfig
from neuronx_distributed_inference.models.llama.modeling_llama import LlamaInferenceConfig, NeuronLlamaForCausalLM
from neuronx_distributed_inference.models.mixtral.modeling_mixtral import read_moe_fields


class Llama4InferenceConfig(LlamaInferenceConfig):
    def get_required_attributes(self) -> list[str]:
        return [*super().get_required_attributes(), "num_local_experts", "num_experts_per_tok"]

    @classmethod
    def get_neuron_config_cls(cls) -> type[NeuronConfig]:
        return MoENeuronConfig


class NeuronLlama4TextForCausalLM(NeuronLlamaForCausalLM):
    def build_modules(self) -> None:
        router = self.neuron_config.router_config  # type: ignore[attr-defined]
        router.dtype, router.act_fn = "float32", "sigmoid"  # L345-L346
        read_moe_fields(self.neuron_config)

    @classmethod
    def get_config_cls(cls) -> type[Llama4InferenceConfig]:
        return Llama4InferenceConfig
