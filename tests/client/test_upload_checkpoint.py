"""``compilesvc upload DIR``: a Hugging Face checkpoint directory uploaded as a reproducible archive, run as the
CLI runs it against the real API on a socket (SQLite ledger, local store). The same checkpoint from another
path with other file times is the same URI; the archive is one an hf-checkpoint submit accepts, keyed as the
directory is; what must not be archived is a one-line error with exit status 2 and no temporary file left."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.checkpoints import Checkpoints
from tests.fixtures.tokens import make_token
from tests.fleet.conftest import FleetApi, serving
from tests.spec.test_keys import needs_nxdi_toolchain
from tests.web.conftest import (
    EnvFactory,
    make_env,  # noqa: F401  (the fixture, for this module)
)


@pytest.fixture
def api(make_env: EnvFactory, sqlite_url: str, tmp_path: Path) -> Iterator[FleetApi]:  # noqa: F811
    with serving(lambda url: make_env(sqlite_url, public_url=url, allow_file_models=True), tmp_path) as served:
        served.token = make_token(served.env.services.sessions, "submit", owner="ci")
        yield served


def upload(api: FleetApi, path: Path, tmp: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPILESVC_", "AWS_"))}
    env.update({"COMPILESVC_API_URL": api.base, "COMPILESVC_TOKEN": api.token, "TMPDIR": str(tmp),
                "COMPILESVC_CONFIG": "/nonexistent/compilesvc.toml"})
    return subprocess.run([sys.executable, "-m", "compilesvc", "upload", str(path)], env=env, capture_output=True,
                          text=True, timeout=120)


def copy_with_other_times(source: Path, dest: Path, mtime: int) -> Path:
    shutil.copytree(source, dest)
    for path in [dest, *dest.rglob("*")]:
        os.utime(path, (mtime, mtime))
    (dest / "model.safetensors").chmod(0o600)
    return dest


def test_the_same_checkpoint_anywhere_is_the_same_archive_and_uri(
        api: FleetApi, tiny_checkpoints: Checkpoints, tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    copy = copy_with_other_times(tiny_checkpoints.base, tmp_path / "elsewhere" / "llama", 1_000_000)
    first, second = upload(api, tiny_checkpoints.base, spool), upload(api, copy, spool)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    uri = first.stdout.strip()
    assert uri.startswith("blob:sha256:") and second.stdout.strip() == uri
    assert list(spool.iterdir()) == []  # the temporary archive is gone
    fine_tune = upload(api, tiny_checkpoints.fine_tune, spool)
    assert fine_tune.returncode == 0 and fine_tune.stdout.strip() != uri  # other weights, other bytes

    # The archive: config.json first, every file at the root, no owner, time or pax timestamp.
    with api.env.services.store.open_blob(uri.rsplit(":", 1)[1]) as blob, tarfile.open(fileobj=blob) as tar:
        members = tar.getmembers()
    assert members[0].name == "config.json"
    assert sorted(m.name for m in members[1:]) == [m.name for m in members[1:]]
    assert {m.name for m in members} == {p.name for p in tiny_checkpoints.base.iterdir()}
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) for m in members} == {(0, 0, 0, "", "", 0o644)}
    assert all(not m.pax_headers for m in members)


@needs_nxdi_toolchain
def test_an_uploaded_checkpoint_is_keyed_as_its_directory(api: FleetApi, tiny_checkpoints: Checkpoints,
                                                          tmp_path: Path) -> None:
    uploaded = upload(api, tiny_checkpoints.sharded, tmp_path)
    assert uploaded.returncode == 0, uploaded.stderr
    keys = []
    for uri in (uploaded.stdout.strip(), tiny_checkpoints.sharded.as_uri()):
        spec = {"model": {"uri": uri, "format": "hf-checkpoint"}, "target": "trn2", "sdk": "2.29.0",
                "neuron_config": {"tp_degree": 8, "seq_len": 128}}
        response = api.env.submit(spec)
        assert response.status_code == 202, response.get_data(as_text=True)
        keys.append(response.json["artifact_key"])
    assert keys[0] == keys[1]


def test_what_cannot_be_archived_is_one_line_and_exit_2(api: FleetApi, tiny_checkpoints: Checkpoints,
                                                         tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    outside = tmp_path / "secret.txt"
    outside.write_text("not the checkpoint's")
    leaking = tmp_path / "leaking"
    shutil.copytree(tiny_checkpoints.base, leaking)
    (leaking / "notes.txt").symlink_to(outside)
    inside = tmp_path / "inside"  # a link within the directory is archived as its file
    shutil.copytree(tiny_checkpoints.base, inside)
    (inside / "generation_config.json").rename(inside / "real.json")
    (inside / "generation_config.json").symlink_to("real.json")
    fifo = tmp_path / "fifo"
    shutil.copytree(tiny_checkpoints.base, fifo)
    os.mkfifo(fifo / "pipe")
    sock_dir = tmp_path / "sock"
    shutil.copytree(tiny_checkpoints.base, sock_dir)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(sock_dir / "s"))
    no_config = tmp_path / "no-config"
    shutil.copytree(tiny_checkpoints.base, no_config)
    (no_config / "config.json").unlink()
    loop = tmp_path / "loop"
    shutil.copytree(tiny_checkpoints.base, loop)
    (loop / "again").symlink_to(".")
    try:
        for directory, says in [(leaking, "symbolic link leaving the checkpoint directory"),
                                (fifo, "not a regular file or directory"), (sock_dir, "not a regular file"),
                                (no_config, "has no config.json"), (loop, "a loop")]:
            result = upload(api, directory, spool)
            assert result.returncode == 2, (directory, result.stderr)
            assert result.stdout == "" and len(result.stderr.splitlines()) == 1, result.stderr
            assert result.stderr.startswith("error: ") and says in result.stderr, result.stderr
            assert list(spool.iterdir()) == []
    finally:
        listener.close()
    linked = upload(api, inside, spool)
    assert linked.returncode == 0, linked.stderr
    assert list(spool.iterdir()) == []
