"""An hf-checkpoint archive whose extension header declares 1 GiB (a ~1 MB gzip, or a 1 MB plain tar) is refused
with a 422 naming the cap, at submit and at resolve, before ``tarfile`` reads the payload
(:mod:`compilesvc.store.tar_caps`); the API process (this test's, under Flask's test client) grows by far less than
the 1 GiB the header asks for."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from tests.fixtures.archive_bombs import pax_bomb, truncated_bomb
from tests.spec.test_keys import needs_nxdi_toolchain
from tests.web.support import Env
from tests.web.test_submit import assert_problem

pytestmark = needs_nxdi_toolchain

#: Far above what reading a few headers costs, far below the 1 GiB the unbounded read allocated.
RSS_BOUND = 256 * 1024**2


def _peak_reset() -> int:
    """This process's RSS now, after resetting its peak (VmHWM) to it (Linux >= 4.0: "5" to clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_bytes("VmRSS")


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


@pytest.mark.parametrize("archive, cap", [
    (pax_bomb(), "pax-header"),
    (truncated_bomb(), "pax-header"),
    (truncated_bomb(kind=tarfile.GNUTYPE_LONGNAME), "long-name"),
], ids=["gzip-pax-1GiB", "tar-pax-1GiB", "tar-longname-1GiB"])
def test_a_header_declaring_a_gib_is_a_422_naming_the_cap_within_a_memory_bound(
        sqlite_env: Env, archive: bytes, cap: str) -> None:
    assert len(archive) < 1_100_000
    uri = sqlite_env.upload(archive)
    spec = {"model": {"uri": uri, "format": "hf-checkpoint"}, "target": "trn2", "sdk": "2.29.0",
            "neuron_config": {"tp_degree": 8, "seq_len": 128}}
    baseline = _peak_reset()
    submitted = assert_problem(sqlite_env.submit(spec), 422, "model-ref-invalid")
    resolved = assert_problem(sqlite_env.client.post("/v1/artifacts/resolve", json=spec), 422, "model-ref-invalid")
    growth = _status_bytes("VmHWM") - baseline
    for body in (submitted, resolved):
        assert body["errors"][0]["field"] == "model.uri"
        message = body["errors"][0]["message"]
        assert f"archive header cap: {cap}" in message and "1073741824 bytes" in message, message
    assert growth < RSS_BOUND, f"the API process grew by {growth / 1024**2:.0f} MiB"
