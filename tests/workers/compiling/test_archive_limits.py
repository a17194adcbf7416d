"""Extraction caps on hf-dir archives, with real small archives that would expand past a cap: refused
before anything is written, with a code per cap, as a final compile error (through the real child too)."""

from __future__ import annotations

import io
import shutil
import tarfile
from pathlib import Path

import pytest

from compilesvc.config.settings import Settings
from compilesvc.states import ErrorClass
from compilesvc.store.tar_caps import MAX_CHAINED_HEADERS, ArchiveHeaderTooLarge, open_capped
from tests.fixtures.archive_bombs import header_block, long_chain, pax_bomb, truncated_bomb
from tests.workers import run_child, text_inputs
from workers.compiling.archive_limits import (
    HEADER_TOO_LARGE,
    RATIO,
    RATIO_FLOOR_BYTES,
    TOO_LARGE,
    TOO_MANY_FILES,
    ArchiveLimitExceeded,
    safe_extract,
)
from workers.compiling.classify import classify
from workers.compiling.contract import CompileFailure, ExtractLimits

MiB = 1024**2


class Zeros(io.RawIOBase):
    """``size`` zero bytes, made as they are read: a big member is packed without being held anywhere."""

    def __init__(self, size: int):
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        n = min(len(buffer), self.left)
        buffer[:n] = bytes(n)
        self.left -= n
        return n


def pack(path: Path, members: dict[str, int]) -> Path:
    """A gzipped tar with ``config.json`` and members of the given sizes (zeros: they compress ~1000x)."""
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo("model/config.json")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"{}"))
        for name, size in members.items():
            info = tarfile.TarInfo(f"model/{name}")
            info.size = size
            tar.addfile(info, io.BufferedReader(Zeros(size)))
    return path


def used_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.exists() else 0


def test_total_bytes_cap(tmp_path: Path) -> None:
    archive = pack(tmp_path / "big.tar.gz", {"a.bin": MiB, "b.bin": 2 * MiB})
    dest = tmp_path / "hf-model"
    with pytest.raises(ArchiveLimitExceeded) as refused:
        safe_extract(archive, dest, ExtractLimits(max_bytes=2 * MiB, max_files=100, max_ratio=1e9))
    assert refused.value.code == TOO_LARGE and refused.value.error_class is ErrorClass.COMPILE
    assert "'model/b.bin'" in refused.value.message and "COMPILESVC_HF_EXTRACT_MAX_BYTES" in refused.value.message
    assert used_bytes(dest) == 0  # refused from the headers: nothing was written


def test_file_count_cap(tmp_path: Path) -> None:
    archive = pack(tmp_path / "many.tar.gz", {f"shard-{i}.bin": 1 for i in range(50)})
    dest = tmp_path / "hf-model"
    with pytest.raises(ArchiveLimitExceeded) as refused:
        safe_extract(archive, dest, ExtractLimits(max_bytes=MiB, max_files=20, max_ratio=1e9))
    assert refused.value.code == TOO_MANY_FILES and "more than 20 members" in refused.value.message
    assert used_bytes(dest) == 0


def test_compression_ratio_cap_with_the_default_ratio(tmp_path: Path) -> None:
    # Just past the ratio's floor, in zeros: a few hundred KiB that would write 80 MiB.
    archive = pack(tmp_path / "bomb.tar.gz", {"weights.bin": RATIO_FLOOR_BYTES + 16 * MiB})
    assert archive.stat().st_size < MiB
    dest = tmp_path / "hf-model"
    with pytest.raises(ArchiveLimitExceeded) as refused:
        safe_extract(archive, dest, ExtractLimits(max_ratio=Settings(_env_file=None).hf_extract_max_ratio))
    assert refused.value.code == RATIO and "COMPILESVC_HF_EXTRACT_MAX_RATIO" in refused.value.message
    assert used_bytes(dest) == 0


def test_an_archive_within_the_caps_extracts(tmp_path: Path) -> None:
    archive = pack(tmp_path / "ok.tar.gz", {"model.safetensors": MiB})
    root = safe_extract(archive, tmp_path / "hf-model", ExtractLimits(max_bytes=2 * MiB, max_files=2))
    assert (root / "model.safetensors").stat().st_size == MiB


def test_the_child_reports_a_cap_as_a_final_compile_error(tmp_path: Path) -> None:
    archive = pack(tmp_path / "big.tar.gz", {"model.safetensors": 4 * MiB})
    run = run_child(tmp_path, "capped", model_path=str(archive), model_format="hf-dir",
                    inputs=text_inputs(1, 8),
                    extract_limits={"max_bytes": MiB, "max_files": 100, "max_ratio": 1000})
    assert run.returncode == 3, run.describe()
    assert run.result is not None and run.result["status"] == "compile_error"
    assert run.result["code"] == TOO_LARGE
    outcome = classify(run.returncode, run.result, run.lines[-50:], timed_out=False, cancelled=False)
    assert outcome.error_class == ErrorClass.COMPILE  # final: not retried as infrastructure
    assert used_bytes(run.work_dir / "hf-model") == 0
    shutil.rmtree(run.work_dir)


def test_a_malformed_cap_in_the_request_is_a_request_error(tmp_path: Path) -> None:
    run = run_child(tmp_path, "bad", extract_limits={"max_bytes": -1, "max_files": 1, "max_ratio": 1})
    assert run.returncode == 2 and "extract_limits.max_bytes" in run.stderr, run.describe()


def test_caps_are_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMPILESVC_HF_EXTRACT_MAX_BYTES", str(5 * MiB))
    monkeypatch.setenv("COMPILESVC_HF_EXTRACT_MAX_FILES", "7")
    monkeypatch.setenv("COMPILESVC_HF_EXTRACT_MAX_RATIO", "3.5")
    settings = Settings(_env_file=None)
    assert (settings.hf_extract_max_bytes, settings.hf_extract_max_files, settings.hf_extract_max_ratio) == (
        5 * MiB, 7, 3.5)
    assert issubclass(ArchiveLimitExceeded, CompileFailure)


@pytest.mark.parametrize("archive, cap", [
    (pax_bomb(), "pax-header"),
    (truncated_bomb(kind=tarfile.GNUTYPE_LONGLINK), "long-name"),
    (long_chain(MAX_CHAINED_HEADERS + 1), "chained-headers"),
    (header_block(tarfile.GNUTYPE_SPARSE, 0, "holes.bin") + bytes(1024), "sparse"),
], ids=["gzip-pax-1GiB", "tar-longlink-1GiB", "pax-chain", "gnu-sparse"])
def test_an_extension_header_past_its_cap_is_refused_before_its_payload_is_read(
        tmp_path: Path, archive: bytes, cap: str) -> None:
    path = tmp_path / "model.tar"
    path.write_bytes(archive)
    with pytest.raises(ArchiveLimitExceeded) as refused:
        safe_extract(path, tmp_path / "out", checkpoint=True)
    assert refused.value.code == HEADER_TOO_LARGE
    assert f"archive header cap: {cap}" in str(refused.value)
    assert not any((tmp_path / "out").iterdir())


def test_a_pax_sparse_member_is_refused_and_small_headers_pass(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("w.bin")
        info.size = 3
        info.pax_headers = {"GNU.sparse.map": "0,3", "GNU.sparse.size": "3"}
        tar.addfile(info, io.BytesIO(b"abc"))
    with pytest.raises(ArchiveHeaderTooLarge, match="sparse"):
        open_capped(fileobj=io.BytesIO(buffer.getvalue())).getmembers()
    # A real long name and a pax header under the caps read as tarfile reads them.
    fine = io.BytesIO()
    long_name = "d/" + "n" * 300 + "/config.json"
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        fine.seek(0)
        fine.truncate()
        with tarfile.open(fileobj=fine, mode="w", format=fmt) as tar:
            info = tarfile.TarInfo(long_name)
            info.size = 2
            tar.addfile(info, io.BytesIO(b"{}"))
        with open_capped(fileobj=io.BytesIO(fine.getvalue())) as tar:
            assert tar.getnames() == [long_name]
