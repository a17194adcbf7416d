"""TEST DOUBLE of ``neuronx_distributed_inference.models.mixtral.modeling_mixtral``. Not the real SDK.

NeuronMixtralForCausalLM overrides get_compiler_args (NXDI@ef2731e models/mixtral/modeling_mixtral.py:L321-L330,
with ``--internal-enable-dge-levels vector_dynamic_offsets``): no --lnc, no --target. Its config requires the
MoE attributes too (num_local_experts, num_experts_per_tok). The double keeps NeuronConfig (the real one uses
MoENeuronConfig, whose extra fields it does not model).
"""

from __future__ import annotations

from neuronx_distributed_inference.models.llama.modeling_llama import LlamaInferenceConfig, NeuronLlamaForCausalLM


class MixtralInferenceConfig(LlamaInferenceConfig):
    def get_required_attributes(self) -> list[str]:
        return [*super().get_required_attributes(), "num_local_experts", "num_experts_per_tok"]


class NeuronMixtralForCausalLM(NeuronLlamaForCausalLM):
    def get_compiler_args(self) -> str:
        return ("--enable-saturate-infinity --enable-mixed-precision-accumulation --model-type transformer -O1 "
                "--tensorizer-options='--enable-ccop-compute-overlap --cc-pipeline-tiling-factor=2' "
                "--internal-enable-dge-levels vector_dynamic_offsets "
                "--internal-hlo2tensorizer-options='--verify-hlo=true'")

    @classmethod
    def get_config_cls(cls) -> type[MixtralInferenceConfig]:
        return MixtralInferenceConfig
