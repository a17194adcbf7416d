"""``COMPILESVC_MODEL_S3_PREFIXES``: checked when a process starts, and matched at bucket and key boundaries
(the API's two-team test is tests/web/test_model_sources.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from compilesvc.config.model_prefixes import parse_s3_prefix
from compilesvc.config.settings import Settings
from compilesvc.pinning.model_sources import may_read


@pytest.mark.parametrize(("setting", "words"), [
    ({"vision": ["https://vision-models/"]}, "is not an s3:// URI"),
    ({"vision": ["s3:///models/"]}, "names no S3 bucket"),
    ({"vision": ["s3://Vision/"]}, "names no S3 bucket"),
    ({"vision": ["s3://vision-models/a/../b/"]}, "'..' segment"),
    ({"vision": "s3://vision-models/"}, "model_s3_prefixes.vision"),
    ({" vision": ["s3://vision-models/"]}, "a team name"),
])
def test_a_bad_setting_stops_the_process_naming_the_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          setting: dict[str, object], words: str) -> None:
    monkeypatch.setenv("COMPILESVC_MODEL_S3_PREFIXES", json.dumps(setting))
    with pytest.raises(ValidationError, match=words):
        Settings(data_dir=tmp_path)


def test_the_setting_is_read_from_the_environment_as_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMPILESVC_MODEL_S3_PREFIXES", '{"vision": ["s3://vision-models/"], "*": ["s3://public"]}')
    settings = Settings(data_dir=tmp_path)
    assert {team: [p.uri for p in prefixes] for team, prefixes in settings.model_prefixes.items()} == {
        "vision": ["s3://vision-models/"], "*": ["s3://public/"]}


@pytest.mark.parametrize(("prefix", "uri", "covered"), [
    ("s3://a-bucket", "s3://a-bucket/m.pt", True),
    ("s3://a-bucket/", "s3://a-bucket/dir/m.pt", True),
    ("s3://a-bucket", "s3://a-bucketx/m.pt", False),     # bucket names compare whole
    ("s3://a-bucket/b", "s3://a-bucket/b", True),
    ("s3://a-bucket/b", "s3://a-bucket/b/m.pt", True),
    ("s3://a-bucket/b", "s3://a-bucket/bc/m.pt", False),  # no "/" in the prefix: a boundary all the same
    ("s3://a-bucket/b/", "s3://a-bucket/b", False),
    ("s3://a-bucket/b/", "s3://a-bucket/bc", False),
    ("s3://a-bucket/b-", "s3://a-bucket/b-c/m.pt", False),  # a prefix is a directory or an object, never a stem
])
def test_a_prefix_covers_keys_at_boundaries(prefix: str, uri: str, covered: bool) -> None:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    assert parse_s3_prefix(prefix).covers(bucket, key) is covered


@pytest.mark.parametrize("key", ["b/../c/m.pt", "b/./m.pt", "b/%2e%2e/c", "b/%252E%252e/c", "b/..\\c", "b/.."])
def test_a_key_with_dot_segments_is_nobodys(tmp_path: Path, key: str) -> None:
    settings = Settings(data_dir=tmp_path, model_s3_prefixes={"t": ["s3://a-bucket/b/"], "*": ["s3://a-bucket/"]})
    assert not may_read(settings, "t", f"s3://a-bucket/{key}")
    assert may_read(settings, "t", "s3://a-bucket/b/c..d/m.pt")  # dots inside a name are a name


def test_every_team_reads_star_and_no_team_reads_only_star(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, model_s3_prefixes={"vision": ["s3://vision-models/"],
                                                              "*": ["s3://public-models/"]})
    assert may_read(settings, "vision", "s3://vision-models/m.pt")
    assert may_read(settings, "nlp", "s3://public-models/m.pt") and may_read(settings, None, "s3://public-models/m")
    assert not may_read(settings, "nlp", "s3://vision-models/m.pt")
    assert not may_read(settings, None, "s3://vision-models/m.pt")
    assert not may_read(Settings(data_dir=tmp_path), "vision", "s3://vision-models/m.pt")  # unset: nobody
