"""The relay's liveness (issue 38, item 6): alive = its loop comes round, failing or not.

After an RDS failover the relay hung silently: no liveness, no timeouts. Here its ledger connection goes
through a proxy that stops forwarding (tests/fixtures/freezing_proxy.py), which no TCP timeout sees; the
rendered probe (``python -m compilesvc.liveness relay``, the chart's livenessProbe and compose's healthcheck)
must fail within the relay's bound, and a test-side supervisor standing in for the kubelet (restart after 2
failed probes, as ``failureThreshold``) restarts it. The new relay, its ledger still unreachable, fails its
passes by libpq's connect timeout and stays alive (a restart would not bring the ledger back); once the proxy
forwards again it recovers by itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from compilesvc.services import Services
from tests.compiles.test_unclaimed import relay_env
from tests.fixtures.freezing_proxy import FreezingProxy
from tests.fixtures.settings import make_settings
from tests.fixtures.waiting import wait_for

pytestmark = pytest.mark.slow

BOUND = 4.0  # COMPILESVC_RELAY_LIVENESS_SECONDS here (120 by default)


class Kubelet:
    """Probes every 0.5 s; after 2 failures in a row, SIGKILLs the relay and starts another (restartPolicy
    Always). Records when each probe failed and every restart."""

    def __init__(self, start: list[str], env: dict[str, str], file: Path):
        self.command, self.env, self.file = start, env, file
        self.read_at_first_failure: dict[str, object] = {}
        self.procs: list[subprocess.Popen[bytes]] = []
        self.failures: list[float] = []
        self.restarts: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def probe(self) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "compilesvc.liveness", "relay"], env=self.env,
                              capture_output=True, text=True, timeout=10)

    def start(self) -> Kubelet:
        self.procs.append(subprocess.Popen(self.command, env=self.env, stdout=subprocess.DEVNULL,
                                           stderr=subprocess.DEVNULL, start_new_session=True))
        wait_for(lambda: self.probe().returncode == 0, 30, "the relay to be alive", interval=0.2)
        self._thread.start()
        return self

    def _run(self) -> None:
        in_a_row = 0
        while not self._stop.wait(0.5):
            if self.probe().returncode == 0:
                in_a_row = 0
                continue
            if not self.failures:
                self.read_at_first_failure = json.loads(self.file.read_text())
            self.failures.append(time.monotonic())
            in_a_row += 1
            if in_a_row >= 2:
                os.killpg(self.procs[-1].pid, signal.SIGKILL)
                self.procs[-1].wait(10)
                self.restarts.append(time.monotonic())
                self.procs.append(subprocess.Popen(self.command, env=self.env, stdout=subprocess.DEVNULL,
                                                   stderr=subprocess.DEVNULL, start_new_session=True))
                in_a_row = 0

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


@pytest.fixture
def services(tmp_path: Path, pg_url: str) -> Iterator[Services]:
    services = Services.from_settings(make_settings(tmp_path, pg_url))
    yield services
    services.close()


def test_a_relay_hung_on_its_ledger_is_restarted_and_recovers(services: Services, tmp_path: Path) -> None:
    url = make_url(services.settings.database_url or "")
    proxy = FreezingProxy(url.port or 5432)
    through = url.set(host="127.0.0.1", port=proxy.port, query={**url.query, "connect_timeout": "2"})
    alive_file = tmp_path / "relay.alive"
    env = relay_env(services, COMPILESVC_DATABASE_URL=through.render_as_string(hide_password=False),
                    COMPILESVC_RELAY_LIVENESS_SECONDS=str(BOUND), COMPILESVC_LIVENESS_FILE=str(alive_file),
                    COMPILESVC_RELAY_INTERVAL_SECONDS="0.2")
    kubelet = Kubelet([str(Path(sys.executable).with_name("compilesvc")), "relay", "--reap-interval", "0.2"],
                      env, alive_file).start()
    try:
        frozen = time.time()
        proxy.freeze()
        wait_for(lambda: kubelet.restarts, 30, "the kubelet to restart the hung relay", interval=0.2)
        # What the probe read had expired within the bound and the back-off wait after the freeze (plus the
        # pass that was running then): the relay promised no more than that.
        assert kubelet.read_at_first_failure["state"] == "alive"
        assert float(str(kubelet.read_at_first_failure["fresh_until"])) <= frozen + BOUND + 0.2 + 2

        # The new relay cannot reach the ledger either: its passes fail by the connect timeout (2 s), and it
        # stays alive, since a restart would not help.
        wait_for(lambda: "failed in a row" in json.loads(alive_file.read_text()).get("detail", ""), 30,
                 "the new relay to report failing passes", interval=0.2)
        time.sleep(BOUND + 1)
        assert len(kubelet.restarts) == 1 and kubelet.procs[-1].poll() is None

        proxy.thaw()
        wait_for(lambda: json.loads(alive_file.read_text()) == {**json.loads(alive_file.read_text()), "detail": "",
                                                                "state": "alive"}, 30,
                 "the relay to recover once the ledger answers", interval=0.2)
        assert len(kubelet.restarts) == 1
    finally:
        kubelet.close()
        proxy.close()
