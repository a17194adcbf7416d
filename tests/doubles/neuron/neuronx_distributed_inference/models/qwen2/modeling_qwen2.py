"""TEST DOUBLE of ``neuronx_distributed_inference.models.qwen2.modeling_qwen2`` (from SDK 2.24). Not the real SDK.

Qwen2InferenceConfig requires the Llama list (NXDI@ef2731e models/qwen2/modeling_qwen2.py); NeuronQwen2ForCausalLM
overrides get_compiler_args with a fixed string (L237-L242), so its compiles get no --lnc and no --target:
the platform comes from NEURON_PLATFORM_TARGET_OVERRIDE at import (docs/research/nxdi.md §5, §6).
"""

from __future__ import annotations

from neuronx_distributed_inference.models.llama.modeling_llama import LlamaInferenceConfig, NeuronLlamaForCausalLM


class Qwen2InferenceConfig(LlamaInferenceConfig):
    pass


class NeuronQwen2ForCausalLM(NeuronLlamaForCausalLM):
    def get_compiler_args(self) -> str:
        return ("--enable-saturate-infinity --enable-mixed-precision-accumulation --auto-cast=none --model-type "
                "transformer -O1 --tensorizer-options='--enable-ccop-compute-overlap --cc-pipeline-tiling-factor=2 "
                "--vectorize-strided-dma' --internal-hlo2tensorizer-options='--verify-hlo=true'")

    @classmethod
    def get_config_cls(cls) -> type[Qwen2InferenceConfig]:
        return Qwen2InferenceConfig
