"""compilesvc.compiles.publishing against a real local store: what a compiler's result may publish, and the first
manifest written under a key being the one every later publisher gets back."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from compilesvc.compiles.leases import Claim
from compilesvc.compiles.publishing import LOG_NAME, PublishError, archive_log, create_or_read, publish_outputs
from compilesvc.spec.keys import bucket_key_of
from compilesvc.spec.manifest import ManifestMismatch, parse_bucket_manifest
from compilesvc.store import LocalStore
from compilesvc.store.base import bucket_manifest_name

MATERIAL = {"model": {"sha256": "0" * 64}, "target": "cpu", "sdk": "torch-2.13"}
INPUTS = [{"name": "x", "shape": [1, 4], "dtype": "float32"}]


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store", public_url="http://api.test", secret_key=b"k")


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "model.pt").write_bytes(b"compiled")
    (out / "sub" / "aux.json").write_bytes(b"{}")
    return out


def claim(material: dict[str, Any] = MATERIAL) -> Claim:
    return Claim(bucket_id=1, key=bucket_key_of(material, INPUTS), token=1, attempt=1, max_attempts=3,
                 target="cpu", sdk="torch-2.13", backend="torchscript", model={}, material=material,
                 inputs=INPUTS, lease_expires_at=datetime.now(UTC))


def test_outputs_are_stored_and_the_manifest_lists_them_by_relative_path(store: LocalStore, out_dir: Path) -> None:
    result = {"files": [{"path": "model.pt", "role": "model"}, {"path": str(out_dir / "sub" / "aux.json")}],
              "versions": {"torch": "2.13.0"}, "compile_seconds": 1.5}
    manifest = publish_outputs(store, claim(), out_dir, result, None, "w1@host")
    assert [(f.path, f.role, f.size) for f in manifest.files] == [("model.pt", "model", 8), ("sub/aux.json", "aux", 2)]
    stored = store.read_document(bucket_manifest_name(manifest.key))
    assert stored is not None and parse_bucket_manifest(stored, manifest.key) == manifest
    with store.open_blob(manifest.files[0].sha256) as blob:
        assert blob.read() == b"compiled"


@pytest.mark.parametrize(("files", "problem"), [
    ([{"path": "../escape.pt"}], "outside the output directory"),
    ([{"path": "/etc/hostname"}], "outside the output directory"),
    ([{"path": "missing.pt"}], "does not exist"),
    ([{"path": "model.pt", "sha256": "f" * 64}], "changed after the compiler reported it"),
    ([], "no files"),
])
def test_a_result_that_cannot_be_published_as_it_is_publishes_nothing(
        store: LocalStore, out_dir: Path, files: list[dict[str, Any]], problem: str) -> None:
    (out_dir.parent / "escape.pt").write_bytes(b"not ours")
    with pytest.raises(PublishError, match=problem):
        publish_outputs(store, claim(), out_dir, {"files": files}, None, "w1@host")
    assert store.read_document(bucket_manifest_name(claim().key)) is None


def test_the_first_manifest_under_a_key_wins_and_later_publishers_get_it_back(store: LocalStore,
                                                                             out_dir: Path) -> None:
    first = publish_outputs(store, claim(), out_dir, {"files": [{"path": "model.pt"}]}, None, "first@host")
    (out_dir / "model.pt").write_bytes(b"another build of the same key")
    second = publish_outputs(store, claim(), out_dir, {"files": [{"path": "model.pt"}]}, None, "second@host")
    assert second == first and second.worker == "first@host"


def test_a_foreign_document_under_the_key_is_refused_not_returned(store: LocalStore, out_dir: Path) -> None:
    mine = publish_outputs(store, claim({**MATERIAL, "sdk": "other"}), out_dir,
                           {"files": [{"path": "model.pt"}]}, None, "w@host")
    foreign = mine.model_copy(update={"key": claim().key})  # claims a key its material does not derive
    with pytest.raises(ManifestMismatch):
        create_or_read(store, bucket_manifest_name(mine.key), foreign, parse_bucket_manifest)


def test_the_log_is_archived_as_a_blob_and_a_refusal_is_not_fatal(store: LocalStore, tmp_path: Path) -> None:
    log_path = tmp_path / LOG_NAME
    log_path.write_text("line 1\n")
    entry = archive_log(store, logs_path=log_path, bucket_id=1)
    assert entry is not None and (entry.path, entry.role, entry.size) == (LOG_NAME, "log", 7)
    with store.open_blob(entry.sha256) as blob:
        assert blob.read() == b"line 1\n"
    assert archive_log(store, logs_path=tmp_path / "gone.log", bucket_id=1) is None
