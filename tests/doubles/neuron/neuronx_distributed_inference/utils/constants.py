"""TEST DOUBLE of ``neuronx_distributed_inference.utils.constants.MODEL_TYPES`` (the models the double has).

NXDI@ef2731e src/neuronx_distributed_inference/utils/constants.py:L49-L68; qwen2 is listed from 2.25
(v0.5.9230 L38-L46) although its class ships from 2.24, qwen3 from 2.25 (docs/research/nxdi.md §4).
"""

from neuronx_distributed_inference.models.llama.modeling_llama import NeuronLlamaForCausalLM
from neuronx_distributed_inference.models.mixtral.modeling_mixtral import NeuronMixtralForCausalLM
from neuronx_distributed_inference.models.qwen2.modeling_qwen2 import NeuronQwen2ForCausalLM
from neuronx_distributed_inference.models.qwen3.modeling_qwen3 import NeuronQwen3ForCausalLM

MODEL_TYPES = {
    "llama": {"causal-lm": NeuronLlamaForCausalLM},
    "mixtral": {"causal-lm": NeuronMixtralForCausalLM},
    "qwen2": {"causal-lm": NeuronQwen2ForCausalLM},
    "qwen3": {"causal-lm": NeuronQwen3ForCausalLM},
}
