"""Settings: the embedded mode's generated secret key."""

from __future__ import annotations

import multiprocessing
import stat
from pathlib import Path

from compilesvc.config.settings import Settings


def _resolve(data_dir: str, barrier: multiprocessing.synchronize.Barrier, out: multiprocessing.Queue) -> None:
    barrier.wait()
    try:
        out.put(Settings(data_dir=Path(data_dir)).resolved_secret_key.decode())
    except Exception as exc:  # reported, so the test shows it
        out.put(f"error: {type(exc).__name__}: {exc}")


def test_processes_starting_together_agree_on_one_generated_key(tmp_path: Path) -> None:
    """gunicorn's workers start at once on a fresh data dir: each must read the same key (download URLs one
    signs, another verifies), and none may fail creating it."""
    context = multiprocessing.get_context("fork")
    for round_ in range(5):
        data_dir = tmp_path / f"data-{round_}"
        barrier, out = context.Barrier(8), context.Queue()
        processes = [context.Process(target=_resolve, args=(str(data_dir), barrier, out)) for _ in range(8)]
        for process in processes:
            process.start()
        keys = [out.get(timeout=30) for _ in processes]
        for process in processes:
            process.join(10)
        assert len(set(keys)) == 1 and not keys[0].startswith("error"), keys
        assert len(keys[0]) == 64
        key_file = data_dir / "secret_key"
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        assert [p.name for p in data_dir.iterdir()] == ["secret_key"]  # no temp files left behind


def test_a_configured_key_is_used_as_is(tmp_path: Path) -> None:
    assert Settings(data_dir=tmp_path, secret_key="configured").resolved_secret_key == b"configured"
    assert not (tmp_path / "secret_key").exists()
