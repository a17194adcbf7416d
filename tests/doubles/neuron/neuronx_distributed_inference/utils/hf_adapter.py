"""TEST DOUBLE of ``neuronx_distributed_inference.utils.hf_adapter.load_pretrained_config``. Not the real SDK.

The function is the real one (NXDI@ef2731e src/neuronx_distributed_inference/utils/hf_adapter.py:L37-L80):
transformers' ``AutoConfig.from_pretrained(path).to_dict()`` goes into the InferenceConfig as it is, so
``_name_or_path`` (the path it was read from) and the checkpoint's ``transformers_version`` end up in
``neuron_config.json``; the HF dtype becomes NeuronConfig.torch_dtype unless the user gave one.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from neuronx_distributed_inference.models.config import InferenceConfig, to_torch_dtype


def load_pretrained_config(model_path_or_name: str | os.PathLike[str] | None = None,
                           hf_config: PretrainedConfig | None = None) -> Any:
    """Return a load_config hook for InferenceConfig that loads the config from a PretrainedConfig."""

    def load_config(self: InferenceConfig) -> None:
        if (model_path_or_name is None and hf_config is None) or (
                model_path_or_name is not None and hf_config is not None):
            raise ValueError('Please provide only one of "model_path_or_name" or "hf_config"')
        if model_path_or_name is not None:
            config: PretrainedConfig = AutoConfig.from_pretrained(model_path_or_name)
        else:
            assert hf_config is not None
            config = hf_config
        config_dict = config.to_dict()
        if config.transformers_version is not None:
            config_dict["transformers_version"] = config.transformers_version
        hf_dtype = config_dict.get("dtype", config_dict.get("torch_dtype", None))
        if hf_dtype is not None:
            if self.neuron_config is not None and not self.neuron_config.overrides_torch_dtype:
                self.neuron_config.torch_dtype = hf_dtype
                if isinstance(self.neuron_config.torch_dtype, str):
                    self.neuron_config.torch_dtype = to_torch_dtype(self.neuron_config.torch_dtype)
            config_dict.pop("dtype", None)
            config_dict.pop("torch_dtype", None)
        for k, v in config_dict.items():
            if isinstance(getattr(config, k, None), PretrainedConfig):
                config_dict[k] = SimpleNamespace(**v)
        self.__dict__.update(config_dict)
        if hasattr(config, "attribute_map"):
            self.attribute_map = config.attribute_map

    return load_config
