"""``compilesvc fetch`` against a real API over HTTP: it never deletes or changes a user's file.

The API (the real app over a SQLite ledger and a local store) serves on a real socket in a thread; its
download URLs go through a TCP relay (:class:`tests.fixtures.relay.RecordingRelay`) that can hold a
download after its headers, so a fetch can be caught mid-download, SIGKILLed, or raced by a second fetch.
``compilesvc fetch`` runs as a subprocess.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from werkzeug.serving import make_server

from compilesvc.cli.fetch_dest import MARKER
from tests.fixtures.relay import RecordingRelay
from tests.fixtures.signing import trust_env
from tests.fixtures.tokens import make_token
from tests.web.conftest import EnvFactory
from tests.web.support import Env, complete_build, spec_for


@dataclass
class Served:
    env: Env
    base: str
    relay: RecordingRelay
    cache: Path  # the fetching host's artifact cache

    def publish(self, *, buckets: tuple[tuple[int, int], ...] = ((1, 8), (2, 8)), model: bytes = b"m") -> str:
        """Publish an artifact (the worker's core paths, no compiler) and return its key."""
        uri = self.env.upload(model)
        response = self.env.submit(spec_for(uri, buckets=buckets))
        assert response.status_code == 202, response.get_data(as_text=True)
        complete_build(self.env.services, response.json["build_id"])
        return str(response.json["artifact_key"])


@pytest.fixture
def served(make_env: EnvFactory, sqlite_url: str, tmp_path: Path) -> Iterator[Served]:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    relay = RecordingRelay(port)
    env = make_env(sqlite_url, public_url=f"http://127.0.0.1:{relay.port}")
    server = make_server("127.0.0.1", port, env.app, threaded=True, fd=listener.fileno())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Served(env, f"http://127.0.0.1:{port}", relay, tmp_path / "fleet-cache")
    finally:
        relay.close()
        server.shutdown()
        thread.join(10)


Run = Callable[..., subprocess.CompletedProcess[str]]


def client_env(served: Served) -> dict[str, str]:
    """The fetching CLI's environment: its token (a fleet host's, which may only fetch)."""
    return {**os.environ, "COMPILESVC_TOKEN": make_token(served.env.services.sessions, "fleet", owner="fleet"),
            "COMPILESVC_CACHE_DIR": str(served.cache), **trust_env(served.env.services)}


def fetch_argv(served: Served, key: str, dest: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "compilesvc", "fetch", key, "--dest", dest, "--api", served.base, *extra]


@pytest.fixture
def run(served: Served) -> Run:
    def run(key: str, dest: str, *extra: str, cwd: Path | None = None, umask: int = 0o022,
            ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(fetch_argv(served, key, dest, *extra), cwd=cwd, umask=umask, capture_output=True,
                              text=True, timeout=120, env=client_env(served))
    return run


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """The user's side of the file system (the API keeps its ledger and store elsewhere in tmp_path)."""
    path = tmp_path / "user"
    path.mkdir()
    return path


def snapshot(root: Path) -> dict[str, tuple[int, bytes | str]]:
    """Every path under ``root`` with its mode and content (or link target): what "untouched" means."""
    out: dict[str, tuple[int, bytes | str]] = {}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        if path.is_symlink():
            out[str(path.relative_to(root))] = (info.st_mode, os.readlink(path))
        elif path.is_file():
            out[str(path.relative_to(root))] = (info.st_mode, path.read_bytes())
        else:
            out[str(path.relative_to(root))] = (info.st_mode, "dir")
    return out


def user_files(root: Path) -> None:
    (root / "notes").mkdir(parents=True)
    (root / "notes" / "todo.txt").write_text("keep me\n")
    (root / "train.py").write_bytes(os.urandom(4096))
    (root / ".hidden").write_text("dotfile")
    (root / "manifest.json").write_text('{"mine": true}')  # a user's own manifest.json is not a marker
    (root / "link").symlink_to("train.py")


def assert_one_error(result: subprocess.CompletedProcess[str], code: int, *words: str) -> None:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for word in words:
        assert word in lines[0], result.stderr


def assert_fetched(served: Served, key: str, dest: Path, *, with_logs: bool = False) -> int:
    """DEST holds exactly the verified artifact, its signature and its marked manifest; returns the file count
    (the artifact's files)."""
    artifact = served.env.client.get(f"/v1/artifacts/{key}").json
    expected = {}
    for bucket in artifact["buckets"]:
        entries = [*bucket["files"], *([bucket["log"]] if with_logs else [])]
        for entry in entries:
            expected[f"bucket-{bucket['position']}/{entry['path']}"] = entry["sha256"]
    files = {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()}
    assert files == {*expected, "manifest.json", "model.sig"}
    for relative, sha in expected.items():
        assert hashlib.sha256((dest / relative).read_bytes()).hexdigest() == sha
    manifest = json.loads((dest / "manifest.json").read_text())
    assert manifest["key"] == key and manifest[MARKER]["key"] == key
    assert set(manifest[MARKER]["files"]) == {*expected, "model.sig"}
    return len(expected)


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".compilesvc-fetch"))


def test_fetch_into_a_new_directory_counts_every_file(served: Served, run: Run, work: Path) -> None:
    key = served.publish()
    dest = work / "deep" / "artifact"
    result = run(key, str(dest), "--with-logs")
    assert result.returncode == 0, result.stderr
    count = assert_fetched(served, key, dest, with_logs=True)
    assert count == 4  # two buckets, a model and a log each
    assert result.stdout.strip() == str(dest)
    assert f"{count} file(s)" in result.stderr and f"{count} downloaded" in result.stderr
    assert leftovers(dest.parent) == [] and leftovers(dest) == []


@pytest.mark.parametrize(("umask", "file_mode", "dir_mode"), [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750),
                                                              (0o002, 0o644, 0o755)])
def test_modes_follow_the_umask(served: Served, run: Run, work: Path, umask: int, file_mode: int,
                                dir_mode: int) -> None:
    key = served.publish()
    dest = work / "artifact"
    assert run(key, str(dest), umask=umask).returncode == 0
    for path in [dest, *dest.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (dir_mode if path.is_dir() else file_mode), (path, oct(mode))


def test_a_directory_of_user_files_is_never_touched(served: Served, run: Run, work: Path) -> None:
    key = served.publish()
    dest = work / "work"
    user_files(dest)
    before = snapshot(work)
    assert_one_error(run(key, str(dest)), 2, "is not empty", "--replace")
    assert snapshot(work) == before
    assert_one_error(run(key, str(dest), "--replace"), 2, "--replace refused", "manifest.json")
    assert snapshot(work) == before


def test_fetch_into_dot_holding_files_is_refused(served: Served, run: Run, work: Path) -> None:
    key = served.publish()
    cwd = work / "checkout"
    user_files(cwd)
    before = snapshot(work)
    assert_one_error(run(key, ".", cwd=cwd), 2, "is not empty")
    assert_one_error(run(key, ".", "--replace", cwd=cwd), 2, "--replace refused")
    assert_one_error(run(key, "sub/..", "--replace", cwd=cwd), 2, "--replace refused")
    assert snapshot(work) == before


def test_fetch_into_an_empty_dot_writes_in_place(served: Served, run: Run, work: Path) -> None:
    key = served.publish()
    cwd = work / "empty"
    cwd.mkdir(mode=0o700)
    inode = cwd.stat().st_ino
    result = run(key, ".", cwd=cwd)
    assert result.returncode == 0, result.stderr
    assert_fetched(served, key, cwd)
    assert cwd.stat().st_ino == inode and stat.S_IMODE(cwd.stat().st_mode) == 0o700  # the directory itself stays
    assert leftovers(cwd) == [] and leftovers(work) == []


def test_replace_swaps_an_earlier_fetch_only(served: Served, run: Run, work: Path) -> None:
    first = served.publish(buckets=((1, 8), (2, 8), (4, 8)))
    second = served.publish(buckets=((1, 16),), model=b"another model")
    dest = work / "artifact"
    assert run(first, str(dest), "--with-logs").returncode == 0
    assert_one_error(run(second, str(dest)), 2, "is not empty")
    assert_fetched(served, first, dest, with_logs=True)

    result = run(second, str(dest), "--replace")
    assert result.returncode == 0, result.stderr
    assert_fetched(served, second, dest)  # bucket-1, bucket-2 and the logs of the first are gone
    assert leftovers(dest) == [] and leftovers(work) == []

    # In place too, from inside the directory.
    assert run(first, ".", "--replace", cwd=dest).returncode == 0
    assert_fetched(served, first, dest)

    # One file the user added (or changed) makes the directory theirs again.
    (dest / "bucket-0" / "mine.txt").write_text("added by hand")
    before = snapshot(work)
    assert_one_error(run(second, str(dest), "--replace"), 2, "bucket-0/mine.txt")
    assert snapshot(work) == before
    (dest / "bucket-0" / "mine.txt").unlink()
    (dest / "bucket-1" / "model.pt").write_bytes(b"edited")
    assert_one_error(run(second, str(dest), "--replace"), 2, "bucket-1/model.pt changed")
    # An edit that keeps the size is the user's too.
    fetched = dest / "bucket-2" / "model.pt"
    original = fetched.read_bytes()
    fetched.write_bytes(bytes([original[0] ^ 1]) + original[1:])
    (dest / "bucket-1" / "model.pt").unlink()
    assert_one_error(run(second, str(dest), "--replace"), 2, "bucket-2/model.pt changed")
    assert fetched.read_bytes() != original  # still the user's bytes


def _start_held_fetch(served: Served, key: str, dest: Path, cwd: Path) -> subprocess.Popen[str]:
    served.relay.hold()
    proc = subprocess.Popen(fetch_argv(served, key, str(dest)), cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=client_env(served))
    assert served.relay.held.wait(60), "the fetch never reached its first download"
    return proc


@pytest.mark.parametrize("existing", [False, True], ids=["absent-dest", "empty-dest"])
def test_a_killed_fetch_is_cleaned_up_by_the_next(served: Served, run: Run, work: Path,
                                                  existing: bool) -> None:
    key = served.publish()
    dest = work / "artifact"
    if existing:
        dest.mkdir()
    proc = _start_held_fetch(served, key, dest, work)
    staging_root = dest if existing else work
    (staging,) = [p for p in staging_root.iterdir() if p.name.endswith(".partial")]
    # Deterministic names, so the next fetch of the same DEST finds them.
    if existing:
        assert staging.name == ".compilesvc-fetch.partial"
    else:
        assert staging.name.startswith(".compilesvc-fetch-artifact-")
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    served.relay.release()
    assert staging.is_dir()  # what a SIGKILL leaves behind
    assert dest.exists() == existing

    result = run(key, str(dest))
    assert result.returncode == 0, result.stderr
    assert_fetched(served, key, dest)
    assert leftovers(work) == [] and leftovers(dest) == []


def test_a_second_fetch_of_the_same_dest_does_not_clobber_the_first(served: Served, run: Run,
                                                                    work: Path) -> None:
    key = served.publish()
    dest = work / "artifact"
    first = _start_held_fetch(served, key, dest, work)
    try:
        (staging,) = [p for p in work.iterdir() if p.name.endswith(".partial")]
        before = snapshot(staging)
        assert_one_error(run(key, str(dest)), 1, "another compilesvc fetch", str(first.pid))
        assert snapshot(staging) == before
    finally:
        served.relay.release()
    _, err = first.communicate(timeout=60)
    assert first.returncode == 0, err
    assert_fetched(served, key, dest)
    assert leftovers(work) == []


def test_errors_leave_nothing_behind(served: Served, run: Run, work: Path) -> None:
    dest = work / "artifact"
    assert_one_error(run("not-a-key", str(dest)), 2, "is not an artifact key")
    assert_one_error(run("0" * 64, str(dest)), 1, "no artifact has key")
    (work / "file").write_text("a file")
    assert_one_error(run("0" * 64, str(work / "file")), 2, "file")
    (work / "dangling").symlink_to(work / "nowhere")
    assert_one_error(run("0" * 64, str(work / "dangling")), 2, "symbolic link")
    assert sorted(p.name for p in work.iterdir()) == ["dangling", "file"]
