"""What an NxD Inference key holds beside the NeuronConfig: the logical NeuronCores NxDI compiles with for the
spec's release, and the checkpoint's config.json in the one spelling NxDI reads the same way (issue 29)."""

from __future__ import annotations

from typing import Any

from compilesvc.spec.checkpoint import CheckpointMaterial
from compilesvc.spec.keys import KeySet, compute_keys, explain
from compilesvc.spec.parsing import parse_spec
from tests.spec.test_keys import needs_nxdi_toolchain

pytestmark = needs_nxdi_toolchain

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
         "num_attention_heads": 4, "num_hidden_layers": 2, "torch_dtype": "bfloat16"}


def keys(sdk: str, config: dict[str, Any] | None = None, target: str = "trn2", **neuron_config: Any) -> KeySet:
    doc = {"model": {"uri": "s3://models/llama/", "format": "hf-checkpoint"}, "target": target, "sdk": sdk,
           "neuron_config": {"tp_degree": 8, "seq_len": 256, **neuron_config}}
    return compute_keys(parse_spec(doc), model_sha256="ab" * 32, default_isa="",
                        checkpoint=CheckpointMaterial(dict(config or LLAMA), {"model.safetensors": "cd" * 32}))


def test_the_lnc_is_what_nxdi_compiles_with_for_the_release() -> None:
    # 2.21's NxDI has logical_neuron_cores, 1 by default on every target (NXDI@v0.1.0 model_wrapper.py:L121);
    # from 2.22 logical_nc_config defaults to the target's (2 on trn2).
    old = keys("2.21.0")
    assert old.material["neuron_config"]["logical_neuron_cores"] == 1
    assert old.material["toolchain"]["lnc"] == 1
    assert "  lnc         1  (logical NeuronCores, resolved at submit: NxDI 2.21's default;" in "\n".join(explain(old))
    assert keys("2.21.0", logical_neuron_cores=1).key == old.key
    given = keys("2.21.0", logical_neuron_cores=2)
    assert given.material["toolchain"]["lnc"] == 2
    assert "logical_neuron_cores; NxDI 2.21's default is 1" in "\n".join(explain(given))
    new = keys("2.29.0")
    assert new.material["toolchain"]["lnc"] == new.material["neuron_config"]["logical_nc_config"] == 2
    assert "resolved at submit: trn2's default;" in "\n".join(explain(new))
    assert keys("2.29.0", logical_nc_config=1).material["toolchain"]["lnc"] == 1


def test_transformers_dtype_spelling_is_one_key_where_nxdi_reads_either() -> None:
    """transformers 4.57 saves ``dtype`` where older ones wrote ``torch_dtype``; NxDI reads ``dtype`` first from
    2.27 (NXDI@v0.7.14366 utils/hf_adapter.py:L56), ``torch_dtype`` alone before (v0.6.10598 L56)."""
    new_spelling = {k: v for k, v in LLAMA.items() if k != "torch_dtype"} | {"dtype": "bfloat16"}
    assert keys("2.29.0", new_spelling).key == keys("2.29.0").key
    assert keys("2.27.0", new_spelling).material["model"]["config"]["torch_dtype"] == "bfloat16"
    both = {**LLAMA, "dtype": "float16"}  # dtype wins, as NxDI and transformers take it
    assert keys("2.29.0", both).key == keys("2.29.0", {**LLAMA, "torch_dtype": "float16"}).key
    assert keys("2.26.0", new_spelling).key != keys("2.26.0").key
    # transformers loads a dtype with getattr(torch, value): "torch.bfloat16" fails, and is not "bfloat16".
    assert keys("2.29.0", {**LLAMA, "torch_dtype": "torch.bfloat16"}).key != keys("2.29.0").key
