"""NxD Inference's model hub per release: which Hugging Face architecture (config.json ``architectures[0]``) an
NxDI release can compile, and with which NxDI module and class. Checked at submit, once config.json is known.

NxDI itself has no architecture dispatcher (the caller picks the class; docs/research/nxdi.md §4). The table
maps each HF architecture onto the ``Neuron<Model>ForCausalLM`` class present in the release's source, as
vllm-neuron does at load (``architectures[0]`` split at "For", ``ConditionalGeneration`` -> ``CausalLM``,
``LlavaForConditionalGeneration`` -> pixtral: vllm-project/vllm-neuron@a5ef7c8 vllm_neuron/worker/
neuronx_distributed_model_loader.py:L639-L659). The classes and their lines were listed with
``git grep -n "^class Neuron\\w+For(CausalLM|ConditionalGeneration)"`` over ``src/neuronx_distributed_inference/
models/*/modeling_*.py`` at each release's ref of aws-neuron/neuronx-distributed-inference (the refs of
:mod:`compilesvc.spec.nxdi_fields`; 2.27.1 and 2.30/2.31 assumed as there). Classes that exist but are missing
from NxDI's own ``MODEL_TYPES`` (Qwen2 in 2.24: utils/constants.py@v0.4.7422:L35-L40) are included: NxDI
compiles any class it ships. MistralForCausalLM has a class of its own from 2.29 only.
"""

from __future__ import annotations

from typing import Any

from compilesvc.spec.nxdi_fields import REPO, nxdi_release

PACKAGE = "neuronx_distributed_inference"


class UnsupportedArchitecture(ValueError):
    """config.json names an architecture the release's NxDI has no model class for."""

    def __init__(self, sdk: str, architecture: str, supported: list[str], note: str = ""):
        self.sdk, self.architecture, self.supported = sdk, architecture, supported
        super().__init__(f"architecture {architecture!r} is not in the model hub of NxD Inference of Neuron SDK "
                         f"{sdk}{note}; it supports {', '.join(supported)}")


class CheckpointConfigError(ValueError):
    """config.json lacks what NxDI needs; ``field`` is the path inside config.json."""

    def __init__(self, field: tuple[str | int, ...], message: str):
        super().__init__(message)
        self.field, self.message = field, message


#: column (nxdi_fields) -> HF architecture -> (module under neuronx_distributed_inference, class, line of the class)
_HUB: dict[str, dict[str, tuple[str, str, int]]] = {
    "2.21.0": {
        "DbrxForCausalLM": ("models.dbrx.modeling_dbrx", "NeuronDbrxForCausalLM", 286),
        "LlamaForCausalLM": ("models.llama.modeling_llama", "NeuronLlamaForCausalLM", 944),
        "MixtralForCausalLM": ("models.mixtral.modeling_mixtral", "NeuronMixtralForCausalLM", 308),
        "MllamaForConditionalGeneration": ("models.mllama.modeling_mllama", "NeuronMllamaForCausalLM", 1229),
    },
    "2.21.1": {
        "DbrxForCausalLM": ("models.dbrx.modeling_dbrx", "NeuronDbrxForCausalLM", 286),
        "LlamaForCausalLM": ("models.llama.modeling_llama", "NeuronLlamaForCausalLM", 944),
        "MixtralForCausalLM": ("models.mixtral.modeling_mixtral", "NeuronMixtralForCausalLM", 308),
        "MllamaForConditionalGeneration": ("models.mllama.modeling_mllama", "NeuronMllamaForCausalLM", 1229),
    },
    "2.22": {
        "DbrxForCausalLM": ("models.dbrx.modeling_dbrx", "NeuronDbrxForCausalLM", 286),
        "LlamaForCausalLM": ("models.llama.modeling_llama", "NeuronLlamaForCausalLM", 984),
        "MixtralForCausalLM": ("models.mixtral.modeling_mixtral", "NeuronMixtralForCausalLM", 312),
        "MllamaForConditionalGeneration": ("models.mllama.modeling_mllama", "NeuronMllamaForCausalLM", 1215),
    },
    "2.23": {
        "DbrxForCausalLM": ("models.dbrx.modeling_dbrx", "NeuronDbrxForCausalLM", 286),
        "LlamaForCausalLM": ("models.llama.modeling_llama", "NeuronLlamaForCausalLM", 1077),
        "MixtralForCausalLM": ("models.mixtral.modeling_mixtral", "NeuronMixtralForCausalLM", 314),
        "MllamaForConditionalGeneration": ("models.mllama.modeling_mllama", "NeuronMllamaForCausalLM", 1224),
    },
    "2.24": {
        "DbrxForCausalLM": ("models.dbrx.modeling_dbrx", "NeuronDbrxForCausalLM", 280),
        "LlamaForCausalLM": ("models.llama.modeling_llama", "NeuronLlamaForCausalLM", 1089),
        "MixtralForCausalLM": ("models.mixtral.modeling_mixtral", "NeuronMixtralForCausalLM", 302),
        "MllamaForConditionalGeneration": ("models.mllama.modeling_mllama", "NeuronMllamaForCausalLM", 1167),
        "Qwen2ForCausalLM": ("models.qwen2.modeling_qwen2", "NeuronQwen2ForCausalLM", 189),
    },
    "2.25": {
        "DbrxForCausalLM": ("models.dbrx.modeling_dbrx", "NeuronDbrxForCausalLM", 280),
        "LlamaForCausalLM": ("models.llama.modeling_llama", "NeuronLlamaForCausalLM", 1093),
        "Llama4ForConditionalGeneration": ("models.llama4.modeling_llama4", "NeuronLlama4ForCausalLM", 146),
        "Llama4ForCausalLM": ("models.llama4.modeling_llama4_text", "NeuronLlama4TextForCausalLM", 621),
        "MixtralForCausalLM": ("models.mixtral.modeling_mixtral", "NeuronMixtralForCausalLM", 302),
        "MllamaForConditionalGeneration": ("models.mllama.modeling_mllama", "NeuronMllamaForCausalLM", 1084),
        "Qwen2ForCausalLM": ("models.qwen2.modeling_qwen2", "NeuronQwen2ForCausalLM", 189),
        "Qwen3ForCausalLM": ("models.qwen3.modeling_qwen3", "NeuronQwen3ForCausalLM", 192),
        "Qwen3MoeForCausalLM": ("models.qwen3_moe.modeling_qwen3_moe", "NeuronQwen3MoeForCausalLM", 326),
    },
    "2.26": {
        "DbrxForCausalLM": ("models.dbrx.modeling_dbrx", "NeuronDbrxForCausalLM", 280),
        "LlamaForCausalLM": ("models.llama.modeling_llama", "NeuronLlamaForCausalLM", 1093),
        "Llama4ForConditionalGeneration": ("models.llama4.modeling_llama4", "NeuronLlama4ForCausalLM", 146),
        "Llama4ForCausalLM": ("models.llama4.modeling_llama4_text", "NeuronLlama4TextForCausalLM", 624),
        "MixtralForCausalLM": ("models.mixtral.modeling_mixtral", "NeuronMixtralForCausalLM", 302),
        "MllamaForConditionalGeneration": ("models.mllama.modeling_mllama", "NeuronMllamaForCausalLM", 1081),
        "LlavaForConditionalGeneration": ("models.pixtral.modeling_pixtral", "NeuronPixtralForCausalLM", 112),
        "Qwen2ForCausalLM": ("models.qwen2.modeling_qwen2", "NeuronQwen2ForCausalLM", 189),
        "Qwen3ForCausalLM": ("models.qwen3.modeling_qwen3", "NeuronQwen3ForCausalLM", 192),
        "Qwen3MoeForCausalLM": ("models.qwen3_moe.modeling_qwen3_moe", "NeuronQwen3MoeForCausalLM", 374),
    },
    "2.27.0": {
        "DbrxForCausalLM": ("models.dbrx.modeling_dbrx", "NeuronDbrxForCausalLM", 280),
        "GptOssForCausalLM": ("models.gpt_oss.modeling_gpt_oss", "NeuronGptOssForCausalLM", 983),
        "LlamaForCausalLM": ("models.llama.modeling_llama", "NeuronLlamaForCausalLM", 1425),
        "Llama4ForConditionalGeneration": ("models.llama4.modeling_llama4", "NeuronLlama4ForCausalLM", 147),
        "Llama4ForCausalLM": ("models.llama4.modeling_llama4_text", "NeuronLlama4TextForCausalLM", 653),
        "MixtralForCausalLM": ("models.mixtral.modeling_mixtral", "NeuronMixtralForCausalLM", 302),
        "MllamaForConditionalGeneration": ("models.mllama.modeling_mllama", "NeuronMllamaForCausalLM", 1083),
        "LlavaForConditionalGeneration": ("models.pixtral.modeling_pixtral", "NeuronPixtralForCausalLM", 132),
        "Qwen2ForCausalLM": ("models.qwen2.modeling_qwen2", "NeuronQwen2ForCausalLM", 190),
        "Qwen3ForCausalLM": ("models.qwen3.modeling_qwen3", "NeuronQwen3ForCausalLM", 192),
        "Qwen3MoeForCausalLM": ("models.qwen3_moe.modeling_qwen3_moe", "NeuronQwen3MoeForCausalLM", 483),
    },
    "2.28": {
        "DbrxForCausalLM": ("models.dbrx.modeling_dbrx", "NeuronDbrxForCausalLM", 280),
        "Gemma3ForConditionalGeneration": ("models.gemma3.modeling_gemma3", "NeuronGemma3ForCausalLM", 309),
        "Gemma3ForCausalLM": ("models.gemma3.modeling_gemma3", "NeuronGemma3ForCausalLM", 309),
        "GptOssForCausalLM": ("models.gpt_oss.modeling_gpt_oss", "NeuronGptOssForCausalLM", 982),
        "LlamaForCausalLM": ("models.llama.modeling_llama", "NeuronLlamaForCausalLM", 1438),
        "Llama4ForConditionalGeneration": ("models.llama4.modeling_llama4", "NeuronLlama4ForCausalLM", 147),
        "Llama4ForCausalLM": ("models.llama4.modeling_llama4_text", "NeuronLlama4TextForCausalLM", 653),
        "MixtralForCausalLM": ("models.mixtral.modeling_mixtral", "NeuronMixtralForCausalLM", 302),
        "MllamaForConditionalGeneration": ("models.mllama.modeling_mllama", "NeuronMllamaForCausalLM", 1083),
        "LlavaForConditionalGeneration": ("models.pixtral.modeling_pixtral", "NeuronPixtralForCausalLM", 132),
        "Qwen2ForCausalLM": ("models.qwen2.modeling_qwen2", "NeuronQwen2ForCausalLM", 192),
        "Qwen2VLForConditionalGeneration": ("models.qwen2_vl.modeling_qwen2_vl", "NeuronQwen2VLForCausalLM", 158),
        "Qwen3ForCausalLM": ("models.qwen3.modeling_qwen3", "NeuronQwen3ForCausalLM", 194),
        "Qwen3MoeForCausalLM": ("models.qwen3_moe.modeling_qwen3_moe", "NeuronQwen3MoeForCausalLM", 484),
        "Qwen3VLForConditionalGeneration": ("models.qwen3_vl.modeling_qwen3_vl", "NeuronQwen3VLForCausalLM", 189),
    },
    "2.29-v2": {
        "DbrxForCausalLM": ("models.dbrx.modeling_dbrx", "NeuronDbrxForCausalLM", 280),
        "Gemma3ForConditionalGeneration": ("models.gemma3.modeling_gemma3", "NeuronGemma3ForCausalLM", 316),
        "Gemma3ForCausalLM": ("models.gemma3.modeling_gemma3", "NeuronGemma3ForCausalLM", 316),
        "GptOssForCausalLM": ("models.gpt_oss.modeling_gpt_oss", "NeuronGptOssForCausalLM", 982),
        "LlamaForCausalLM": ("models.llama.modeling_llama", "NeuronLlamaForCausalLM", 1192),
        "Llama4ForConditionalGeneration": ("models.llama4.modeling_llama4", "NeuronLlama4ForCausalLM", 147),
        "Llama4ForCausalLM": ("models.llama4.modeling_llama4_text", "NeuronLlama4TextForCausalLM", 653),
        "MistralForCausalLM": ("models.mistral.modeling_mistral", "NeuronMistralForCausalLM", 190),
        "MixtralForCausalLM": ("models.mixtral.modeling_mixtral", "NeuronMixtralForCausalLM", 302),
        "MllamaForConditionalGeneration": ("models.mllama.modeling_mllama", "NeuronMllamaForCausalLM", 1083),
        "LlavaForConditionalGeneration": ("models.pixtral.modeling_pixtral", "NeuronPixtralForCausalLM", 132),
        "Qwen2ForCausalLM": ("models.qwen2.modeling_qwen2", "NeuronQwen2ForCausalLM", 192),
        "Qwen2VLForConditionalGeneration": ("models.qwen2_vl.modeling_qwen2_vl", "NeuronQwen2VLForCausalLM", 187),
        "Qwen3ForCausalLM": ("models.qwen3.modeling_qwen3", "NeuronQwen3ForCausalLM", 238),
        "Qwen3MoeForCausalLM": ("models.qwen3_moe.modeling_qwen3_moe", "NeuronQwen3MoeForCausalLM", 484),
        "Qwen3VLForConditionalGeneration": ("models.qwen3_vl.modeling_qwen3_vl", "NeuronQwen3VLForCausalLM", 203),
    },
}


#: Image-to-text models, in NxDI's source but refused here: their InferenceConfig takes two NeuronConfigs, one for
#: the text model and one for the vision encoder (NXDI@ef2731e models/image_to_text_model_base.py:L34-L38
#: ``ImageToTextInferenceConfig(text_neuron_config, vision_neuron_config, ...)``; from_json_string builds both,
#: L105-L106), where a spec has one ``neuron_config`` and the worker builds one: such a compile would fail with a
#: TypeError hours into the queue. Compiling them needs a request shape for both configs (issue 41 chose removal
#: until one exists). Mllama keeps one NeuronConfig (MultimodalVisionNeuronConfig) and stays.
IMAGE_TO_TEXT = frozenset({"Llama4ForConditionalGeneration", "LlavaForConditionalGeneration",
                           "Qwen2VLForConditionalGeneration", "Qwen3VLForConditionalGeneration"})
_IMAGE_TO_TEXT_NOTE = (" (an image-to-text model: NxDI builds it from a text and a vision NeuronConfig, "
                       "models/image_to_text_model_base.py:L34-L38, and a spec carries one neuron_config; for its "
                       "text model alone use the text architecture, e.g. Llama4ForCausalLM)")


def _hub(column: str) -> dict[str, tuple[str, str, int]]:
    return {name: entry for name, entry in _HUB[column].items() if name not in IMAGE_TO_TEXT}


def supported_architectures(sdk: str) -> list[str]:
    """The HF architectures ``sdk``'s NxDI can compile, sorted (NotShipped for a release without NxDI)."""
    return sorted(_hub(nxdi_release(sdk).column))


def architecture_class(sdk: str, architectures: Any) -> tuple[str, str]:
    """(module, class) of the NxDI model for config.json's ``architectures`` (its first entry, as vLLM reads it).

    :class:`UnsupportedArchitecture` naming the architecture and the release's supported list.
    """
    rel = nxdi_release(sdk)
    hub = _hub(rel.column)
    if not isinstance(architectures, list) or not architectures or not isinstance(architectures[0], str):
        raise UnsupportedArchitecture(sdk, repr(architectures), sorted(hub), " (config.json must list the model's "
                                      "architecture in \"architectures\", e.g. [\"LlamaForCausalLM\"])")
    name = architectures[0]
    if name in IMAGE_TO_TEXT:
        raise UnsupportedArchitecture(sdk, name, sorted(hub), _IMAGE_TO_TEXT_NOTE)
    if name not in hub:
        later = [column for column, table in _HUB.items() if name in table]
        first = {"2.29-v2": "2.29.0"}.get(later[0], later[0] if later[0].count(".") == 2 else f"{later[0]}.0") \
            if later else ""
        note = f" (NxDI has it from Neuron SDK {first})" if later else ""
        raise UnsupportedArchitecture(sdk, name, sorted(hub), note)
    module, cls, _line = hub[name]
    return f"{PACKAGE}.{module}", cls


def class_path(sdk: str, config: dict[str, Any]) -> str:
    """``"module:Class"`` of the NxDI model the compile of ``config`` (config.json, as the key holds it) builds:
    the compile request's ``nxdi_model``, so the worker builds the class this table admitted at submit."""
    module, cls = architecture_class(sdk, config.get("architectures"))
    return f"{module}:{cls}"


def class_source(sdk: str, architecture: str) -> str:
    """Where the class of ``architecture`` is defined in ``sdk``'s NxDI source (``repo@ref path:Lnnn``)."""
    rel = nxdi_release(sdk)
    module, _cls, line = _HUB[rel.column][architecture]
    where = f"{REPO}@{rel.ref} src/{PACKAGE}/{module.replace('.', '/')}.py:L{line}"
    return f"{where} ({rel.assumed})" if rel.assumed else where


def check_checkpoint_config(sdk: str, config: Any) -> None:
    """config.json has what NxDI needs before the compile starts (hours later otherwise).

    Checked: a JSON object, ``architectures`` naming a model in the release's hub, ``model_type`` a string
    (transformers' AutoConfig, which NxDI's ``load_pretrained_config`` calls, reads it: utils/hf_adapter.py:L49-L76).
    NxDI's own ``Config must define {missing_attributes}`` (models/config.py:L910) is not repeated here: it
    runs on the config *after* transformers filled its class defaults (rope_theta, rms_norm_eps, pad_token_id, …),
    so a config.json without them is still valid, and telling which would need transformers' config classes.
    """
    if not isinstance(config, dict):
        raise CheckpointConfigError((), "config.json must be a JSON object")
    if "architectures" not in config:
        raise CheckpointConfigError(("architectures",), "config.json has no \"architectures\": NxDI's model class is "
                                    "chosen from it (e.g. [\"LlamaForCausalLM\"])")
    try:
        architecture_class(sdk, config["architectures"])
    except UnsupportedArchitecture as exc:
        raise CheckpointConfigError(("architectures", 0), str(exc)) from None
    if not isinstance(config.get("model_type"), str) or not config["model_type"]:
        raise CheckpointConfigError(("model_type",), "config.json has no \"model_type\": transformers' AutoConfig, "
                                    "which NxDI loads the checkpoint's config with, needs it")
