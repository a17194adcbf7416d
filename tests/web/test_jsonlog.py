"""compilesvc.jsonlog: one JSON object per line, extras as fields, never a failed log call."""

from __future__ import annotations

import io
import json
import logging
import logging.config
from collections.abc import Iterator

import pytest

from compilesvc import jsonlog


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    out = io.StringIO()
    handler = jsonlog.configure("DEBUG", stream=out, service="worker")
    yield out
    logging.getLogger().removeHandler(handler)


def lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_fields_and_extras(stream: io.StringIO) -> None:
    log = logging.getLogger("compilesvc.test")
    log.info("bucket %s done", "abc", extra={"build_id": 7, "bucket_key": "k" * 64, "worker": "w1",
                                             "level": "forged", "tags": {"b", "a"}, "raw": b"\xff"})
    (line,) = lines(stream)
    assert line["msg"] == "bucket abc done" and line["level"] == "INFO" and line["logger"] == "compilesvc.test"
    assert line["service"] == "worker" and line["build_id"] == 7 and line["worker"] == "w1"
    assert line["extra_level"] == "forged", "extras never overwrite core fields"
    assert line["tags"] == ["a", "b"] and line["raw"] == "\ufffd"
    assert isinstance(line["ts"], str) and line["ts"].endswith("Z") and len(line["ts"]) == 24


def test_exceptions_stay_on_one_line(stream: io.StringIO) -> None:
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        logging.getLogger("x").exception("failed")
    assert len(stream.getvalue().splitlines()) == 1
    (line,) = lines(stream)
    assert "ValueError: bad\nthing" in str(line["exc"])


def test_unencodable_extras_do_not_lose_the_line(stream: io.StringIO) -> None:
    loop: list[object] = []
    loop.append(loop)
    logging.getLogger("x").warning("odd", extra={"loop": loop})
    (line,) = lines(stream)
    assert line["msg"] == "odd" and "loop" in line


def test_configure_is_idempotent(stream: io.StringIO) -> None:
    again = io.StringIO()
    handler = jsonlog.configure("INFO", stream=again)
    try:
        marked = [h for h in logging.getLogger().handlers if getattr(h, "_compilesvc_jsonlog", False)]
        assert marked == [handler]
        logging.getLogger("x").info("once")
        assert len(again.getvalue().splitlines()) == 1 and stream.getvalue() == ""
    finally:
        logging.getLogger().removeHandler(handler)


def test_gunicorn_logconfig_is_valid_dictconfig() -> None:
    config = jsonlog.gunicorn_logconfig("INFO", service="api")
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        logging.config.dictConfig(config)
        formatter = logging.getLogger("gunicorn.error").handlers[0].formatter
        assert isinstance(formatter, jsonlog.JsonFormatter) and formatter.static == {"service": "api"}
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])


def test_level_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMPILESVC_LOG_LEVEL", "debug")
    assert jsonlog.level_from_env() == "DEBUG"
    monkeypatch.setenv("COMPILESVC_LOG_LEVEL", "loud")
    assert jsonlog.level_from_env() == "INFO"
