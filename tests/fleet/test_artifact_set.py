"""``ArtifactSet`` as serving code uses it: open by key or spec, pick the bucket, pad, load and run a real
TorchScript model; refuse a host the artifact was not built for."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest

from compilesvc.fleet import ArtifactSet, NoBucketFits, NotCached, NotPublished, VersionMismatch, pad
from tests.fleet.conftest import FleetApi
from tests.web.support import spec_for


def opener(api: FleetApi, tmp_path: Path) -> dict[str, object]:
    return {"cache_dir": tmp_path / "lib-cache", "api_url": api.base, "token": api.token}


def scripted_model() -> bytes:
    """A real TorchScript module (sums token ids where the mask is set), as a cpu worker would save one."""
    torch = pytest.importorskip("torch")

    class Summer(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return (input_ids * attention_mask).sum(dim=1)

    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(Summer()), buffer)
    return buffer.getvalue()


def test_open_select_pad_load_and_run(fleet_api: FleetApi, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    key = fleet_api.publish(buckets=((1, 16), (4, 16), (1, 64)), versions={"torch": torch.__version__})
    artifacts = ArtifactSet.open(key, **opener(fleet_api, tmp_path))  # type: ignore[arg-type]
    assert artifacts.key == key and [b.position for b in artifacts.buckets] == [0, 1, 2]
    assert artifacts.report.network and artifacts.host.mismatches == []
    for bucket in artifacts.buckets:
        assert bucket.model_path.is_file() and bucket.model_path.parent == bucket.directory

    ids = torch.tensor([[3, 4, 5]])
    mask = torch.ones_like(ids)
    bucket = artifacts.select({"input_ids": ids, "attention_mask": mask})
    assert bucket.shapes == {"input_ids": (1, 16), "attention_mask": (1, 16)}
    with pytest.raises(NoBucketFits, match="input_ids dim 1 is 100, the largest compiled is 64"):
        artifacts.select({"input_ids": (1, 100), "attention_mask": (1, 100)})
    assert artifacts.select({"input_ids": (2, 10), "attention_mask": (2, 10)}).position == 1


def test_a_real_torchscript_bucket_loads_and_runs(fleet_api: FleetApi, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    key = fleet_api.publish(buckets=((1, 16), (2, 16)), payload=lambda _: scripted_model(),
                            versions={"torch": torch.__version__})
    artifacts = ArtifactSet.open(key, **opener(fleet_api, tmp_path))  # type: ignore[arg-type]
    ids = torch.tensor([[3, 4, 5]])
    request = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    bucket = artifacts.select(request)
    module = bucket.load()
    assert module(**pad(request, bucket)).tolist() == [12]  # padding is masked out


def test_open_by_spec_and_offline_again(fleet_api: FleetApi, tmp_path: Path) -> None:
    key = fleet_api.publish()
    spec = spec_for(fleet_api.env.upload(b"m"))
    first = ArtifactSet.open(spec, **opener(fleet_api, tmp_path))  # type: ignore[arg-type]
    assert first.key == key
    fleet_api.stop()
    again = ArtifactSet.open(spec, cache_dir=tmp_path / "lib-cache", offline=True)
    assert again.key == key and again.report.network is False
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec))
    assert ArtifactSet.open(spec_file, cache_dir=tmp_path / "lib-cache", offline=True).key == key
    with pytest.raises(NotCached):
        ArtifactSet.open("f" * 64, cache_dir=tmp_path / "lib-cache", offline=True)


def test_not_published_and_not_a_key(fleet_api: FleetApi, tmp_path: Path) -> None:
    building = fleet_api.env.submit(spec_for(fleet_api.env.upload(b"other"))).json
    with pytest.raises(NotPublished) as caught:
        ArtifactSet.open(building["artifact_key"], **opener(fleet_api, tmp_path))  # type: ignore[arg-type]
    assert caught.value.state == "building"
    with pytest.raises(NotPublished, match="build it first"):
        ArtifactSet.open(spec_for(fleet_api.env.upload(b"other")), **opener(fleet_api, tmp_path))  # type: ignore[arg-type]
    with pytest.raises(Exception, match="neither an artifact key"):
        ArtifactSet.open("not-a-key", **opener(fleet_api, tmp_path))  # type: ignore[arg-type]


def test_a_host_that_cannot_load_it_is_refused_or_warned(fleet_api: FleetApi, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    key = fleet_api.publish(versions={"torch_neuronx": "2.9.0.2.11.19912", "aws_neuronx_runtime_lib": "2.29.40.0"})
    with pytest.raises(VersionMismatch, match=re.escape("torch-neuronx: built with 2.9.0.2.11.19912")):
        ArtifactSet.open(key, **opener(fleet_api, tmp_path))  # type: ignore[arg-type]
    monkeypatch.setenv("COMPILESVC_HOST_CHECK", "warn")
    with pytest.warns(UserWarning, match="torch-neuronx"):
        artifacts = ArtifactSet.open(key, **opener(fleet_api, tmp_path))  # type: ignore[arg-type]
    assert artifacts.host.mismatches
    assert ArtifactSet.open(key, host_check="off", **opener(fleet_api, tmp_path)).host.mismatches == []  # type: ignore[arg-type]
