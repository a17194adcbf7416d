"""The checkpoint directory a worker makes for an NxD Inference compile: from an uploaded archive (extracted by
the worker with its caps) or from a checkpoint pinned file by file, with a tiny Llama checkpoint from
transformers as the input."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest

from compilesvc.config.settings import Settings
from compilesvc.pinning.identity import ModelResolver
from compilesvc.spec.compile_spec import ModelRef
from compilesvc.store import LocalStore
from tests.fixtures.checkpoints import Checkpoints, tar_of
from workers.compiling.archive_limits import TOO_MANY_FILES
from workers.compiling.checkpoint_dirs import ARCHIVE_NAME, materialise_checkpoint
from workers.compiling.contract import CompileFailure, ExtractLimits


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "artifacts", public_url="http://127.0.0.1:1", secret_key=b"k" * 32)


def pinned_fetch(resolver: ModelResolver, uri: str) -> dict[str, object]:
    return resolver.pin(ModelRef(uri=uri, format="hf-checkpoint")).fetch


def test_an_archive_becomes_the_directory_holding_config_json(
        tmp_path: Path, store: LocalStore, tiny_checkpoints: Checkpoints) -> None:
    resolver = ModelResolver(Settings(data_dir=tmp_path / "data"), store, None)
    uri = f"blob:sha256:{store.put_stream(io.BytesIO(tar_of(tiny_checkpoints.base, top='llama'))).sha256}"
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    root = materialise_checkpoint(resolver, pinned_fetch(resolver, uri), model_dir, ExtractLimits())
    assert root == model_dir / "checkpoint" / "llama"
    assert sorted(p.name for p in root.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert (root / "model.safetensors").read_bytes() == (tiny_checkpoints.base / "model.safetensors").read_bytes()
    assert not (model_dir / ARCHIVE_NAME).exists()  # the child reads the directory alone

    capped = tmp_path / "capped"
    capped.mkdir()
    with pytest.raises(CompileFailure) as raised:
        materialise_checkpoint(resolver, pinned_fetch(resolver, uri), capped, ExtractLimits(max_files=2))
    assert raised.value.code == TOO_MANY_FILES
    assert not any((capped / "checkpoint").rglob("*.safetensors"))  # nothing extracted


def test_a_directory_pinned_file_by_file_is_copied_verified(tmp_path: Path, tiny_checkpoints: Checkpoints) -> None:
    source = tmp_path / "source"
    shutil.copytree(tiny_checkpoints.sharded, source)
    resolver = ModelResolver(Settings(data_dir=tmp_path / "data", allow_file_models=True), None, None)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    root = materialise_checkpoint(resolver, pinned_fetch(resolver, source.as_uri()), model_dir, ExtractLimits())
    assert root == model_dir / "checkpoint"
    assert sorted(p.name for p in root.iterdir()) == sorted(p.name for p in source.iterdir())
