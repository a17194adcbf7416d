"""docs/fleet.md's blocks, run as written against a real service and a real artifact (two buckets of a tiny
exported program, compiled by the TorchScript backend): every ``compilesvc fetch`` form, the signature check
with model-signing's own verifier and ``compilesvc verify``, and the serving code, which loads the buckets,
selects, pads, runs and crops. KEY and the public key file are placeholders :func:`fill` replaces."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from compilesvc.signing.keys import TRUSTED_KEYS_ENV, public_key_path
from tests.docs.conftest import MakeCluster, Shell
from tests.docs.test_client_blocks import write_spec
from tests.fixtures.docs import doc_block, fill


def test_fleet_blocks(make_cluster: MakeCluster, tiny_torch_model: Path, tmp_path: Path,
                      monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = make_cluster()
    port = cluster.start_service()
    work = tmp_path / "host"
    work.mkdir()
    spec = write_spec(work, cluster.upload(tiny_torch_model.read_bytes(), "model.pt2"))
    key = cluster.submit(spec).artifact_key
    cluster.wait_artifact(key, ("published",), timeout=180)
    public_key = public_key_path(cluster.settings.data_dir / "signing-key.pem")
    env = {**cluster.client_env(port, work), "COMPILESVC_CACHE_DIR": str(work / "cache"),
           TRUSTED_KEYS_ENV: str(public_key)}
    shell = Shell(env, work)

    fetches = [line for line in fill(doc_block("fleet.md", "## `compilesvc fetch`"), {"KEY": key}).splitlines()]
    out = {line.split("#")[0].strip(): shell.run(line, timeout=180).stdout for line in fetches}
    directory = work / "cache" / "v1" / "artifacts" / key
    assert out[f"compilesvc fetch {key}"].strip() == str(directory)
    assert (work / "artifact" / "manifest.json").is_file()
    assert json.loads(out[f"compilesvc fetch {key} --json"])["directory"] == str(directory)

    shutil.rmtree(work / "artifact")
    shutil.copy(public_key, work / "compilesvc.pub.pem")  # the file the block names: the service's public key
    shell.run(fill(doc_block("fleet.md", "so the standard verifier works on the directory as it is"), {"KEY": key}))

    scope: dict[str, Any] = {"KEY": key, "TooLarge": ValueError, "tokenizer": SimpleNamespace(pad_token_id=0)}
    for name, value in env.items():  # ArtifactSet.open reads the client's environment, as on a serving host
        monkeypatch.setenv(name, value)
    exec(doc_block("fleet.md", "one place that imports torch.", lang="python"), scope)
    for batch, seq in ((1, 11), (2, 20)):  # each padded into the smallest bucket that fits, then cropped
        ids = torch.randint(1, 100, (batch, seq))
        assert scope["infer"](ids, torch.ones_like(ids)).shape[0] == batch
