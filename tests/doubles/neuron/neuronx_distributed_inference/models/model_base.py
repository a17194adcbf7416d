"""TEST DOUBLE of ``neuronx_distributed_inference.models.model_base.NeuronBaseForCausalLM``. Not the real SDK.

The constructor refuses chunked prefill (NXDI@ef2731e src/neuronx_distributed_inference/models/model_base.py:
L3054-L3055) and enables the context-encoding and token-generation submodels (L3057-L3068). Their buckets are
NxDI's (modules/autobucketing.py:L8-L19 generate_buckets, L149-L279 for CTE/TKG: [max_context_length] /
[seq_len] without bucketing; the given lists, else powers of two from 128) and their compiler flags the model
wrapper's default (models/model_wrapper.py:L85-L167) unless the model overrides ``get_compiler_args``, whose
string is then used verbatim: no --lnc, no --target (L145-L146).
"""

from __future__ import annotations

import math

from neuronx_distributed_inference.models.application_base import NeuronApplicationBase
from neuronx_distributed_inference.models.config import InferenceConfig, NeuronConfig, nxdi_minor

CONTEXT_ENCODING_MODEL_TAG = "context_encoding_model"
TOKEN_GENERATION_MODEL_TAG = "token_generation_model"


def generate_buckets(min_length: int, max_length: int) -> list[int]:
    """NXDI@ef2731e modules/autobucketing.py:L8-L19."""
    if min_length == max_length:
        return [max_length]
    min_bound = int(math.log2(min_length))
    max_bound = round(math.log2(max_length))
    return [2**i for i in range(min_bound, max_bound)] + [max_length]


class NeuronBaseForCausalLM(NeuronApplicationBase):
    def __init__(self, model_path: str, config: InferenceConfig | None = None,
                 neuron_config: NeuronConfig | None = None) -> None:
        super().__init__(model_path, config, neuron_config)
        if self.neuron_config.is_chunked_prefill:
            raise NotImplementedError("Chunked Prefill is not available in NxDI for now")

    def _buckets(self, tag: str) -> list[int]:
        nc = self.neuron_config
        if tag == CONTEXT_ENCODING_MODEL_TAG:
            if not nc.enable_bucketing:
                return [nc.max_context_length]
            return nc.context_encoding_buckets or generate_buckets(128, nc.max_context_length)
        if not nc.enable_bucketing:
            return [nc.seq_len]
        return nc.token_generation_buckets or generate_buckets(128, nc.max_length)

    def _default_flags(self, tag: str) -> str:
        """model_wrapper.py:L85-L139 (2.29) for CTE/TKG, with NxD's --verbose=35 (2.27+, NXD 47f695c L120-L122)."""
        nc = self.neuron_config
        tiling = 1 if tag == TOKEN_GENERATION_MODEL_TAG else nc.cc_pipeline_tiling_factor
        tensorizer = (f"--tensorizer-options='--enable-ccop-compute-overlap --cc-pipeline-tiling-factor={tiling} "
                      f"--vectorize-strided-dma '")
        args = f"--auto-cast=none --model-type=transformer {tensorizer} --lnc={nc.logical_nc_config}"
        if nc.scratchpad_page_size:
            args += f" --hbm-scratchpad-page-size={nc.scratchpad_page_size} "
        args += " -O1 " if tag == CONTEXT_ENCODING_MODEL_TAG else " -O2 "
        if nc.target:
            args += f" --target {nc.target}"
        args += " --internal-hlo2tensorizer-options='--verify-hlo=true' "
        return args

    def submodels(self) -> list[tuple[str, list[int], str]]:
        out = []
        for tag in (CONTEXT_ENCODING_MODEL_TAG, TOKEN_GENERATION_MODEL_TAG):
            flags = self.get_compiler_args() or self._default_flags(tag)
            if nxdi_minor() >= "0.7" and "--verbose" not in flags:
                flags += " --verbose=35"
            out.append((tag, self._buckets(tag), flags))
        return out
