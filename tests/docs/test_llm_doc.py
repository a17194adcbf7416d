"""docs/llm.md's spec, as a user copies it: it validates, its short form expands as the page says, and it keys."""

from __future__ import annotations

import yaml

from compilesvc.spec.checkpoint import CheckpointMaterial
from compilesvc.spec.keys import compute_keys
from compilesvc.spec.parsing import parse_spec
from tests.fixtures.checkpoints import Checkpoints
from tests.fixtures.docs import doc_block


def test_the_llm_spec_validates_and_keys(tiny_checkpoints: Checkpoints) -> None:
    spec = parse_spec(yaml.safe_load(doc_block("llm.md", "## The spec", lang="yaml")))
    assert spec.backend == "nxdi" and spec.model.is_prefix and spec.tp_degree == 8
    config = spec.nxdi_config
    # "buckets: [128, 512, 2048]" is both bucket lists with bucketing on, as the page says.
    assert config["enable_bucketing"] is True
    assert config["context_encoding_buckets"] == config["token_generation_buckets"] == [128, 512, 2048]
    assert config["torch_dtype"] == "bfloat16" and config["save_sharded_checkpoint"] is False
    # A batch above 1 that vLLM can serve (compilesvc.fleet's check_loadable refuses one without it). Seen: the page's
    # spec compiled an artifact that its own `serve-env` step then refused.
    assert config["batch_size"] > 1 and config["is_continuous_batching"] is True
    material = CheckpointMaterial(config=Checkpoints.config(tiny_checkpoints.base))
    keys = compute_keys(spec, model_sha256="0" * 64, default_isa="x86_64-avx2", checkpoint=material)
    # One compile for the whole model, and the weights are not in its key (the page's "The key").
    assert len(keys.buckets) == 1 and keys.buckets[0].inputs == []
    assert keys.material["model"]["weights"] is None
    fine_tune = CheckpointMaterial(config=Checkpoints.config(tiny_checkpoints.fine_tune))
    assert compute_keys(spec, model_sha256="1" * 64, default_isa="x86_64-avx2", checkpoint=fine_tune).key == keys.key
