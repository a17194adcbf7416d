"""TEST DOUBLE of ``neuronx_distributed_inference.models.mixtral.modeling_mixtral``. Not the real SDK.

NeuronMixtralForCausalLM overrides get_compiler_args (NXDI@ef2731e models/mixtral/modeling_mixtral.py:L321-L330,
with ``--internal-enable-dge-levels vector_dynamic_offsets``): no --lnc, no --target. Its config requires the
MoE attributes too (num_local_experts, num_experts_per_tok) and its NeuronConfig class is MoENeuronConfig
(``get_neuron_config_cls``, L156-L158). Building its MoE modules reads the MoE fields: ``glu_mlp`` (asserted True,
L56), ``router_config.dtype``/``act_fn`` (modules/moe_v2.py:L42-L43), ``blockwise_matmul_config`` (L77-L79) and
``hybrid_sharding_config`` (L34): with the base NeuronConfig that is an AttributeError, as in NxDI.
"""

from __future__ import annotations

from neuronx_distributed_inference.models.config import MoENeuronConfig, NeuronConfig
from neuronx_distributed_inference.models.llama.modeling_llama import LlamaInferenceConfig, NeuronLlamaForCausalLM


class MixtralInferenceConfig(LlamaInferenceConfig):
    def get_required_attributes(self) -> list[str]:
        return [*super().get_required_attributes(), "num_local_experts", "num_experts_per_tok"]

    @classmethod
    def get_neuron_config_cls(cls) -> type[NeuronConfig]:
        return MoENeuronConfig


def read_moe_fields(neuron_config: NeuronConfig) -> None:
    """What ``initialize_moe_module`` reads (NXDI@ef2731e modules/moe_v2.py:L34-L79)."""
    _ = neuron_config.hybrid_sharding_config  # type: ignore[attr-defined]
    _ = (neuron_config.router_config.dtype, neuron_config.router_config.act_fn)  # type: ignore[attr-defined]
    _ = (neuron_config.glu_mlp, neuron_config.glu_type)  # type: ignore[attr-defined]
    _ = neuron_config.blockwise_matmul_config.parallelize_token_to_block_mapping  # type: ignore[attr-defined]


class NeuronMixtralForCausalLM(NeuronLlamaForCausalLM):
    def get_compiler_args(self) -> str:
        return ("--enable-saturate-infinity --enable-mixed-precision-accumulation --model-type transformer -O1 "
                "--tensorizer-options='--enable-ccop-compute-overlap --cc-pipeline-tiling-factor=2' "
                "--internal-enable-dge-levels vector_dynamic_offsets "
                "--internal-hlo2tensorizer-options='--verify-hlo=true'")

    def build_modules(self) -> None:
        read_moe_fields(self.neuron_config)
        assert self.neuron_config.glu_mlp is True, "Only GLU MLP is supported for Mixtral Top-K model"  # type: ignore[attr-defined]

    @classmethod
    def get_config_cls(cls) -> type[MixtralInferenceConfig]:
        return MixtralInferenceConfig
