"""The fault suite's scale knob and the recovery bounds it derives (tests/faults/scale.py, recovery.py);
the suite itself is slow (tests/faults), these are not."""

from __future__ import annotations

import pytest

from compilesvc.config.settings import Settings
from tests.faults.recovery import Bounds
from tests.faults.scale import OUTAGE_ENV, SCALE_ENV, SCALES, current


def test_ci_is_the_default_and_lighter_than_heavy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SCALE_ENV, raising=False)
    monkeypatch.delenv(OUTAGE_ENV, raising=False)
    ci, heavy = current(), SCALES["heavy"]
    assert ci == SCALES["ci"]
    assert ci.outage_seconds < heavy.outage_seconds == 60 and ci.queued_builds < heavy.queued_builds == 12


def test_heavy_by_name_and_an_explicit_outage_overrides_both(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SCALE_ENV, " Heavy ")
    monkeypatch.setenv(OUTAGE_ENV, "7.5")
    scale = current()
    assert (scale.name, scale.queued_builds, scale.outage_seconds, scale.fetch_outage_seconds) == \
        ("heavy", 12, 7.5, 7.5)


def test_an_unknown_scale_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SCALE_ENV, "huge")
    with pytest.raises(ValueError, match="ci, heavy"):
        current()


def test_the_ci_outage_outlasts_what_it_must_prove() -> None:
    settings = Settings.model_validate({"lease_seconds": 3, "worker_stale_seconds": 10, "retry_backoff_seconds": 1,
                                        "retry_backoff_max_seconds": 5})  # the fault cluster's (conftest.py)
    for outage in (SCALES["ci"].outage_seconds, SCALES["ci"].fetch_outage_seconds):
        assert outage > max(settings.lease_seconds, settings.worker_stale_seconds,
                            2 * settings.retry_backoff_max_seconds)


def test_bounds_follow_the_settings() -> None:
    fault_cluster = Bounds(Settings.model_validate({"dispatch_grace_seconds": 2, "lease_seconds": 3,
                                                    "retry_backoff_max_seconds": 5, "relay_interval_seconds": 0.2}))
    assert fault_cluster.resend[0] == 2 + 1.5 + 3  # grace + reap interval (lease / 2) + two passes >= grace
    assert fault_cluster.retry_after_heal[0] == 5 + 3
    assert fault_cluster.claim_and_compile[0] == pytest.approx(0.2 + 5 + 3)
    defaults = Bounds(Settings.model_validate({}))  # grace 30 s, reaper every 5 s
    assert defaults.resend[0] == 30 + 5 + 30
