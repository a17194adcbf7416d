"""A fleet booting: many hosts' processes fetching one key into one cache, booting again with the API
gone, a flipped byte on disk, a download killed halfway, a cache no reader may write."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path

from tests.fleet.conftest import FleetApi
from tests.web.support import spec_for

MIB = 1024 * 1024


def cache_files(cache: Path, key: str) -> dict[str, str]:
    """Every file of the cached artifact directory by relative path, with its sha256."""
    directory = cache / "v1" / "artifacts" / key
    return {p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name not in ("manifest.json", "model.sig")}


def expected_files(api: FleetApi, key: str) -> dict[str, str]:
    return {f"bucket-{b['position']}/{f['path']}": f["sha256"]
            for b in api.manifest(key)["buckets"] for f in b["files"]}


def test_eight_processes_download_each_file_once(fleet_api: FleetApi) -> None:
    key = fleet_api.publish(buckets=((1, 8), (2, 8), (4, 8)), size=2 * MIB)
    fleet_api.relay.rate = 8 * MIB  # downloads take a while, so the eight overlap
    procs = [subprocess.Popen(fleet_api.argv(key, "--json", "-q"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=fleet_api.environ()) for _ in range(8)]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        reports.append(json.loads(out))
    expected = expected_files(fleet_api, key)
    assert len(expected) == 3
    assert cache_files(fleet_api.cache, key) == expected  # every file there and verified
    assert {r["directory"] for r in reports} == {str(fleet_api.cache / "v1" / "artifacts" / key)}
    for sha in expected.values():
        assert fleet_api.blob_gets(sha) == 1, sha  # one download of each file, fleet-wide
    assert sum(r["downloaded"] for r in reports) == 3
    assert sum(r["received_bytes"] for r in reports) == 3 * 2 * MIB
    # Nothing half-done is left: no partial downloads, no staging directories.
    assert list((fleet_api.cache / "v1" / "partial").iterdir()) == []
    assert list((fleet_api.cache / "v1" / "staging").iterdir()) == []


def test_a_cached_key_boots_with_the_api_gone(fleet_api: FleetApi, tmp_path: Path) -> None:
    key = fleet_api.publish()
    expected = expected_files(fleet_api, key)
    spec_file = tmp_path / "spec.json"
    uri = fleet_api.env.upload(b"m")
    spec_file.write_text(json.dumps(spec_for(uri)))
    first = fleet_api.fetch_json("--spec", str(spec_file))
    assert first["key"] == key and first["network"] is True
    fleet_api.stop()

    for args in ((key,), ("--spec", str(spec_file)), (key, "--offline")):
        again = fleet_api.fetch_json(*args)
        assert again["network"] is False and again["downloaded"] == 0, args
        assert again["directory"] == first["directory"]
    assert cache_files(fleet_api.cache, key) == expected

    # A key the cache does not have cannot be had without the API: one line, exit 1.
    missing = fleet_api.fetch("0" * 64, "--offline")
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1, missing.stderr
    assert "not in the cache" in missing.stderr
    unreachable = fleet_api.fetch("1" * 64, timeout=60)
    assert unreachable.returncode == 1 and "cannot reach the API" in unreachable.stderr, unreachable.stderr


def test_a_flipped_byte_is_detected_and_only_that_file_refetched(fleet_api: FleetApi) -> None:
    key = fleet_api.publish(size=256 * 1024)
    fleet_api.fetch_json(key)
    expected = expected_files(fleet_api, key)
    victim = fleet_api.cache / "v1" / "artifacts" / key / "bucket-1" / "model.pt"
    original = victim.read_bytes()
    os.chmod(victim, 0o644)
    with open(victim, "r+b") as f:  # in place, as a failing disk would (the blob shares the inode)
        f.seek(1000)
        f.write(bytes([original[1000] ^ 0x01]))

    report = fleet_api.fetch_json(key)
    assert report["downloaded"] == 1 and report["network"] is True
    assert cache_files(fleet_api.cache, key) == expected
    sha = expected["bucket-1/model.pt"]
    assert fleet_api.blob_gets(sha) == 2 and fleet_api.blob_gets(expected["bucket-0/model.pt"]) == 1

    # Offline, the same damage is an error naming the file, never a silent load.
    os.chmod(victim, 0o644)
    with open(victim, "r+b") as f:
        f.write(b"X")
    damaged = fleet_api.fetch(key, "--offline")
    assert damaged.returncode == 1 and "bucket-1/model.pt" in damaged.stderr and "damaged" in damaged.stderr


def test_a_killed_download_resumes_where_it_stopped(fleet_api: FleetApi) -> None:
    size = 24 * MIB
    key = fleet_api.publish(buckets=((1, 8),), size=size)
    sha = expected_files(fleet_api, key)["bucket-0/model.pt"]
    partial = fleet_api.cache / "v1" / "partial" / f"{sha}.part"
    fleet_api.relay.rate = 4 * MIB
    proc = subprocess.Popen(fleet_api.argv(key, "-q"), env=fleet_api.environ(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not (partial.exists() and partial.stat().st_size >= 4 * MIB):
        assert proc.poll() is None and time.monotonic() < deadline, "the download never got going"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    left = partial.stat().st_size
    assert 0 < left < size

    fleet_api.relay.rate = None
    report = fleet_api.fetch_json(key)
    assert report["resumed"] == {"bucket-0/model.pt": left}
    assert report["received_bytes"] == size - left  # only the rest came over the wire
    gets = [s for s in fleet_api.relay.requests_for(f"/v1/blobs/{sha}") if s.method == "GET"]
    assert "range" not in gets[0].headers and gets[-1].headers["range"] == f"bytes={left}-"
    assert cache_files(fleet_api.cache, key) == expected_files(fleet_api, key)
    assert not partial.exists()


def read_only_argv(cache: Path, argv: list[str]) -> list[str]:
    """``argv`` run with ``cache`` read-only: a read-only bind mount in a private mount namespace where
    this user may make one (root: a read-only volume for real), else the tree's write bits cleared."""
    if os.geteuid() == 0 and shutil.which("unshare"):
        probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
        if probe.returncode == 0:
            script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
            return ["unshare", "-m", "sh", "-c", script, str(cache), *argv]
    for path in [cache, *cache.rglob("*")]:
        os.chmod(path, stat.S_IMODE(path.stat().st_mode) & ~0o222)
    return argv


def tree(root: Path) -> dict[str, tuple[int, float]]:
    return {str(p): (p.stat().st_mode, p.stat().st_mtime) for p in sorted(root.rglob("*"))}


def test_a_read_only_cache_serves_readers_without_writing_or_locking(fleet_api: FleetApi, tmp_path: Path) -> None:
    key = fleet_api.publish()
    cache = tmp_path / "baked"
    filled = fleet_api.fetch(key, "--cache-dir", str(cache), "-q")
    assert filled.returncode == 0, filled.stderr
    for path in [cache, *cache.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode & 0o004, (path, oct(mode))  # a serving process of another user reads it all
    shutil.rmtree(cache / "v1" / "locks")  # readers must not need the writers' lock files
    before = tree(cache)
    fleet_api.stop()  # and no API either

    result = subprocess.run(read_only_argv(cache, fleet_api.argv(key, "--cache-dir", str(cache), "--json")),
                            capture_output=True, text=True, timeout=60, env=fleet_api.environ())
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["network"] is False
    assert tree(cache) == before  # not a byte, not a lock file, not a directory

    # The same reader cannot fill the cache: a clear refusal, not a traceback.
    missing = subprocess.run(read_only_argv(cache, fleet_api.argv("2" * 64, "--cache-dir", str(cache))),
                             capture_output=True, text=True, timeout=60, env=fleet_api.environ())
    assert missing.returncode == 1, missing.stderr
    assert missing.stderr.startswith("error: ") and "not in the read-only cache" in missing.stderr
