"""``compilesvc key`` on hf-checkpoint specs (NxD Inference), run as the installed console script: the key of a
checkpoint directory, --explain with its NeuronConfig and config.json, and the one-line refusals.

Every test keys an nxdi spec, which needs the release table's NxDI versions (``needs_nxdi_toolchain``)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.cli.test_main import CLI, Run, clean_env, key_of
from tests.fixtures.checkpoints import Checkpoints
from tests.spec.test_keys import needs_nxdi_toolchain

pytestmark = needs_nxdi_toolchain


@pytest.fixture
def run(tmp_path: Path) -> Run:
    def _run(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(CLI), *map(str, args)], env=env if env is not None else clean_env(tmp_path),
                              cwd=tmp_path, capture_output=True, text=True, timeout=60)

    return _run


def llm_spec(tmp: Path, uri: str, **neuron_config: Any) -> Path:
    path = tmp / f"llm-{len(list(tmp.glob('llm-*')))}.json"
    path.write_text(json.dumps({"model": {"uri": uri, "format": "hf-checkpoint"}, "target": "trn2", "sdk": "2.29.0",
                                "neuron_config": {"tp_degree": 8, "seq_len": 128, **neuron_config}}))
    return path


def test_key_of_a_checkpoint_directory_and_its_fine_tune(run: Run, tmp_path: Path,
                                                         tiny_checkpoints: Checkpoints) -> None:
    base = key_of(run("key", llm_spec(tmp_path, tiny_checkpoints.base.as_uri())))
    assert key_of(run("key", llm_spec(tmp_path, tiny_checkpoints.fine_tune.as_uri()))) == base
    presharded = key_of(run("key", llm_spec(tmp_path, tiny_checkpoints.base.as_uri(), save_sharded_checkpoint=True)))
    tune_presharded = key_of(run("key", llm_spec(tmp_path, tiny_checkpoints.fine_tune.as_uri(),
                                                 save_sharded_checkpoint=True)))
    assert len({base, presharded, tune_presharded}) == 3

    explained = run("key", "--explain", llm_spec(tmp_path, tiny_checkpoints.base.as_uri()))
    assert explained.returncode == 0, explained.stderr
    lines = explained.stdout.splitlines()
    assert lines[0] == f"artifact key  {base}"
    assert any(line.startswith("neuron_config ") and '"tp_degree": 8' in line for line in lines)
    assert any(line.startswith("model ") and '"num_hidden_layers": 2' in line for line in lines)
    assert any(line.startswith("  weights     not in the key") for line in lines)


def test_checkpoints_that_cannot_be_keyed_are_one_line_errors(run: Run, tmp_path: Path,
                                                              tiny_checkpoints: Checkpoints) -> None:
    no_config = tmp_path / "no-config"
    shutil.copytree(tiny_checkpoints.base, no_config)
    (no_config / "config.json").unlink()
    cases = [
        (f"blob:sha256:{'a' * 64}", "an uploaded checkpoint is keyed by the config.json inside it"),
        (no_config.as_uri(), "the checkpoint has no config.json at its root"),
    ]
    for uri, says in cases:
        result = run("key", llm_spec(tmp_path, uri), env=clean_env(tmp_path))
        assert result.returncode == 2, result.stderr
        assert result.stdout == "" and len(result.stderr.splitlines()) == 1
        assert result.stderr.startswith("error: ") and says in result.stderr
