"""Submitting hf-checkpoint models (NxD Inference): a tiny Llama checkpoint saved by transformers, uploaded as an
archive, keyed by its config.json; a fine-tune joins its base's compile unless weights are pre-sharded; a config
change is a miss explained in one line; a checkpoint NxDI cannot compile is refused naming model.uri.

Tests marked ``needs_nxdi_toolchain`` need the release table's NxDI versions (they key an nxdi spec).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from compilesvc.builds.submit import Submitter
from compilesvc.insights.key_diff import explain_miss
from compilesvc.ledger.models import Build
from compilesvc.pinning.pins import ModelRefError
from compilesvc.services import Services
from compilesvc.spec.parsing import parse_spec
from tests.fixtures.checkpoints import Checkpoints, tar_of
from tests.spec.test_keys import needs_nxdi_toolchain


def upload_checkpoint(services: Services, directory: Path) -> str:
    path = services.settings.data_dir / f"{directory.name}.tar"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(tar_of(directory, top=directory.name))
    return f"blob:sha256:{services.store.put_file(path).sha256}"


def llm_doc(uri: str, name: str = "tiny-llama", **neuron_config: Any) -> dict[str, Any]:
    return {"model": {"uri": uri, "format": "hf-checkpoint", "name": name}, "target": "trn2", "sdk": "2.29.0",
            "neuron_config": {"tp_degree": 8, "batch_size": 1, "seq_len": 128, **neuron_config}}


def miss_texts(services: Services, build_id: int) -> list[str] | None:
    with services.sessions() as session:
        compared = explain_miss(session, session.get_one(Build, build_id))
    return None if compared is None else [change.text for change in compared.changes]


@needs_nxdi_toolchain
def test_a_fine_tune_joins_its_base_and_a_config_change_is_a_one_line_miss(
        services: Services, tiny_checkpoints: Checkpoints) -> None:
    submitter = Submitter(services)
    base = submitter.submit(parse_spec(llm_doc(upload_checkpoint(services, tiny_checkpoints.base))))
    assert base.outcome == "new" and len(base.buckets) == 1
    tune_uri = upload_checkpoint(services, tiny_checkpoints.fine_tune)
    tune = submitter.submit(parse_spec(llm_doc(tune_uri, name="tiny-llama-ft")))
    assert (tune.outcome, tune.artifact_key) == ("join", base.artifact_key)  # weights are loaded at load time

    presharded = submitter.submit(parse_spec(llm_doc(tune_uri, save_sharded_checkpoint=True)))
    assert presharded.outcome == "new" and presharded.artifact_key != base.artifact_key

    deeper = submitter.submit(parse_spec(llm_doc(upload_checkpoint(services, tiny_checkpoints.deeper))))
    assert deeper.outcome == "new"
    assert miss_texts(services, deeper.build_id) == ["model.config.num_hidden_layers 2 → 4"]
    tp16 = submitter.submit(parse_spec(llm_doc(upload_checkpoint(services, tiny_checkpoints.base), tp_degree=16)))
    found = miss_texts(services, tp16.build_id)
    assert found is not None and "neuron_config.tp_degree 8 → 16" in found


def test_a_checkpoint_nxdi_cannot_compile_is_refused_on_model_uri(
        services: Services, tiny_checkpoints: Checkpoints, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoints.base, broken)
    (broken / "config.json").write_text(json.dumps({"model_type": "llama"}))
    no_weights = tmp_path / "no-weights"
    shutil.copytree(tiny_checkpoints.base, no_weights)
    (no_weights / "model.safetensors").unlink()
    submitter = Submitter(services)
    for directory, says in [(broken, "config.json names no architectures"),
                            (no_weights, "no weights beside it")]:
        # A client's parse (the release table is not consulted): the refusal comes from pinning, before any key.
        spec = parse_spec(llm_doc(upload_checkpoint(services, directory)), extra_flags=None)
        with pytest.raises(ModelRefError) as raised:
            submitter.keys_for(spec)
        assert raised.value.field == "model.uri"
        assert says in raised.value.message
