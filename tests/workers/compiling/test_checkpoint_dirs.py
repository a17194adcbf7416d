"""The checkpoint directory a worker makes for an NxD Inference compile: from an uploaded archive (extracted by
the worker with its caps) or from a checkpoint pinned file by file, with a tiny Llama checkpoint from
transformers as the input."""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path

import pytest

from compilesvc.config.settings import Settings
from compilesvc.pinning.identity import ModelResolver
from compilesvc.pinning.pins import ModelChangedError
from compilesvc.spec.compile_spec import ModelRef
from compilesvc.store import LocalStore
from tests.fixtures.checkpoints import Checkpoints, aliasing_archives, tar_of
from workers.compiling.archive_limits import TOO_MANY_FILES, safe_extract
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


def test_the_worker_refuses_an_archive_pinning_would_refuse(tmp_path: Path, tiny_checkpoints: Checkpoints) -> None:
    # The same members pinning refuses (tests/pinning/test_checkpoints.py): were one let through (an archive pinned
    # before the rule), the data filter would extract a link or let the last copy win.
    for n, (case, (data, member)) in enumerate(aliasing_archives(tiny_checkpoints.base).items()):
        archive = tmp_path / f"{n}.tar"
        archive.write_bytes(data)
        with pytest.raises(CompileFailure) as raised:
            safe_extract(archive, tmp_path / f"out-{n}", checkpoint=True)
        assert raised.value.code == "HF_DIR_UNSAFE_ARCHIVE", case
        assert repr(member) in raised.value.message, case


def test_the_directory_handed_to_the_compile_has_the_pinned_config_and_weights(
        tmp_path: Path, store: LocalStore, tiny_checkpoints: Checkpoints) -> None:
    source = tmp_path / "source"
    shutil.copytree(tiny_checkpoints.base, source)
    resolver = ModelResolver(Settings(data_dir=tmp_path / "data", allow_file_models=True), store, None)
    pinned = resolver.pin(ModelRef(uri=source.as_uri(), format="hf-checkpoint"), weight_digests=True)
    assert set(pinned.fetch["verify"]) == {"config.json", "model.safetensors"}
    # config.json rewritten in place, size and mtime kept: the copy passes its (size, mtime) pin, the digest does not.
    config = source / "config.json"
    st = config.stat()
    original = config.read_bytes()
    config.write_bytes(original.replace(b'"num_hidden_layers": 2', b'"num_hidden_layers": 3'))
    assert config.stat().st_size == st.st_size
    os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns))
    (tmp_path / "m1").mkdir()
    with pytest.raises(ModelChangedError, match=r"config\.json in the checkpoint directory has sha256"):
        materialise_checkpoint(resolver, pinned.fetch, tmp_path / "m1", ExtractLimits())
    config.write_bytes(original)
    os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns))
    (tmp_path / "m2").mkdir()
    assert materialise_checkpoint(resolver, pinned.fetch, tmp_path / "m2", ExtractLimits()) == tmp_path / "m2" / \
        "checkpoint"

    # An archive: its pinned digests are checked on the extracted root too.
    uri = f"blob:sha256:{store.put_stream(io.BytesIO(tar_of(tiny_checkpoints.base, top='llama'))).sha256}"
    fetch = dict(pinned_fetch(resolver, uri))
    fetch["verify"] = {**fetch["verify"], "model.safetensors": "0" * 64}  # weights other than the key's
    (tmp_path / "m3").mkdir()
    with pytest.raises(ModelChangedError, match=r"model\.safetensors in the checkpoint directory has sha256"):
        materialise_checkpoint(resolver, fetch, tmp_path / "m3", ExtractLimits())
