"""POST /v1/builds with an hf-checkpoint NxD Inference cannot compile: a 422 naming model.uri and the problem.

Needs the release table's NxDI versions (an nxdi spec is validated against them before its model is pinned)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.fixtures.checkpoints import Checkpoints, tar_of
from tests.spec.test_keys import needs_nxdi_toolchain
from tests.web.support import Env
from tests.web.test_submit import assert_problem

pytestmark = needs_nxdi_toolchain


def test_a_checkpoint_without_config_json_or_weights_is_a_422_on_model_uri(
        sqlite_env: Env, tiny_checkpoints: Checkpoints, tmp_path: Path) -> None:
    no_config = tmp_path / "no-config"
    shutil.copytree(tiny_checkpoints.base, no_config)
    (no_config / "config.json").unlink()
    bad_json = tmp_path / "bad-json"
    shutil.copytree(tiny_checkpoints.base, bad_json)
    (bad_json / "config.json").write_text("{")
    no_weights = tmp_path / "no-weights"
    shutil.copytree(tiny_checkpoints.base, no_weights)
    (no_weights / "model.safetensors").unlink()
    for directory, says in [(no_config, "no config.json at its root"), (bad_json, "config.json is not valid JSON"),
                            (no_weights, "no weights beside it")]:
        spec = {"model": {"uri": sqlite_env.upload(tar_of(directory)), "format": "hf-checkpoint"},
                "target": "trn2", "sdk": "2.29.0", "neuron_config": {"tp_degree": 8, "seq_len": 128}}
        body = assert_problem(sqlite_env.submit(spec), 422, "model-ref-invalid")
        assert body["errors"][0]["field"] == "model.uri", json.dumps(body)
        assert says in body["errors"][0]["message"]
