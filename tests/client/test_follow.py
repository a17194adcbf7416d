"""What the CI client says about a build and which exit status a finished build gets (compilesvc.client.follow),
and where the client finds the API and its token (compilesvc.client.config)."""

from __future__ import annotations

from pathlib import Path

import pytest

from compilesvc.client import config as client_config
from compilesvc.client.follow import Exit, Follower, failure_report, outcome

INPUTS = [{"name": "input_ids", "shape": [2, 128], "dtype": "int64"}]


def bucket(position: int, state: str, error_class: str | None = None, **extra: object) -> dict[str, object]:
    return {"key": f"k{position}", "position": position, "inputs": INPUTS, "state": state, "attempts": 1,
            "error_class": error_class, "error_code": None, "error_message": None, **extra}


@pytest.mark.parametrize(("state", "classes", "expected"), [
    ("succeeded", [], Exit.OK),
    ("cancelled", ["cancelled"], Exit.CANCELLED),
    ("failed", ["compile"], Exit.COMPILE_ERROR),
    ("failed", ["unknown"], Exit.COMPILE_ERROR),
    ("failed", ["bad_request"], Exit.BAD_INPUT),
    ("failed", ["infra"], Exit.INFRA),
    ("failed", ["timeout"], Exit.INFRA),
    ("failed", ["model"], Exit.INFRA),
    ("failed", ["infra", "compile"], Exit.COMPILE_ERROR),  # retrying cannot make the model compile
    ("failed", [None], Exit.INFRA),
])
def test_a_finished_build_maps_to_its_exit_status(state: str, classes: list[str | None], expected: Exit) -> None:
    bucket_state = "failed" if state != "succeeded" else "succeeded"
    build = {"build_id": 7, "state": state, "buckets": [bucket(i, bucket_state, c) for i, c in enumerate(classes)]}
    assert outcome(build) == expected


def test_a_failure_names_the_bucket_by_shape_and_keeps_the_whole_message() -> None:
    message = "x" * 500 + "\n[NCC_EXTP004] the operator aten::foo is not supported"
    build = {"build_id": 7, "state": "failed",
             "buckets": [bucket(0, "succeeded"), bucket(1, "failed", "compile", error_code="NCC_EXTP004",
                                                        error_message=message)]}
    lines = failure_report(build, {"k1": ["last compiler line"]})
    assert "bucket 1 (input_ids: int64[2, 128]) failed: compile NCC_EXTP004" in lines
    assert "    [NCC_EXTP004] the operator aten::foo is not supported" in lines  # not cut at 200 characters
    assert lines[-1] == "    | last compiler line"
    assert not any("bucket 0" in line for line in lines)


def test_the_follower_says_each_change_once() -> None:
    follower = Follower()
    build = {"build_id": 7, "state": "building", "buckets": [bucket(0, "queued")]}
    assert follower.changes(build) == ["bucket 0 (input_ids: int64[2, 128]): queued"]
    assert follower.changes(build) == []
    build = {"build_id": 7, "state": "succeeded",
             "buckets": [bucket(0, "succeeded", compile_seconds=12.34)]}
    assert follower.changes(build) == ["bucket 0 (input_ids: int64[2, 128]): queued -> succeeded in 12.3 s",
                                       "build 7: building -> succeeded"]
    assert follower.progress(build).startswith("[####################] 1/1 succeeded")


def test_an_nxdi_compile_is_named_for_what_it_is() -> None:
    # Its one bucket has no inputs (every sequence bucket is inside NxDI's model.pt): not "bucket 0 ()".
    build = {"build_id": 8, "state": "building", "buckets": [bucket(0, "running", inputs=[], worker_id="w1")]}
    assert Follower().changes(build) == ["bucket 0 (the whole NxDI model): running on w1"]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for name in (client_config.TOKEN_ENV, client_config.API_ENV):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "config.toml"
    monkeypatch.setenv(client_config.CONFIG_ENV, str(path))
    return path


def test_the_token_comes_from_the_environment_before_the_file(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert client_config.load() == client_config.ClientConfig(client_config.DEFAULT_API, None, "default", None)
    clean_env.write_text('api_url = "https://svc.example"\ntoken = "csvc_from_file"\n')
    clean_env.chmod(0o600)
    loaded = client_config.load()
    assert (loaded.api_url, loaded.token, loaded.token_source) == ("https://svc.example", "csvc_from_file",
                                                                  str(clean_env))
    monkeypatch.setenv(client_config.TOKEN_ENV, "csvc_from_env")
    monkeypatch.setenv(client_config.API_ENV, "https://env.example")
    assert (client_config.load().token, client_config.load().api_url) == ("csvc_from_env", "https://env.example")
    assert client_config.load("https://option.example").api_url == "https://option.example"


def test_a_token_file_others_can_read_is_refused(clean_env: Path) -> None:
    clean_env.write_text('token = "csvc_secret"\n')
    clean_env.chmod(0o644)
    with pytest.raises(client_config.ConfigError, match="chmod 600"):
        client_config.load()
    clean_env.write_text("token = 42\n")
    clean_env.chmod(0o600)
    with pytest.raises(client_config.ConfigError, match="token must be a string"):
        client_config.load()
    clean_env.write_text("token = \n")
    with pytest.raises(client_config.ConfigError, match="not TOML"):
        client_config.load()
