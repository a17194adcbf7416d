"""The CI client as a pipeline uses it: tests/ci/pipeline.sh (a shell script, as in docs/ci.md) against a
running stack (API, relay, a worker with the Neuron double), through a proxy that can lose an answer."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from compilesvc.ledger.models import Build
from tests.doubles.neuron._release import RELEASES, coded
from tests.fixtures.docs import doc_block
from tests.fixtures.netcut import CuttingProxy
from tests.fixtures.ports import free_port
from tests.fixtures.tokens import BOOTSTRAP_TOKEN
from tests.workers.conftest import HLO_MODEL, NEURON_SDK, Cluster

MakeCluster = Callable[..., Cluster]

SCRIPT = Path(__file__).resolve().parents[1] / "ci" / "pipeline.sh"


def test_a_ci_pipeline_gets_the_documented_exit_statuses(make_cluster: MakeCluster, tmp_path: Path) -> None:
    cluster = make_cluster()
    api_port = cluster.start_service()
    work = tmp_path / "pipeline"
    work.mkdir()
    proxy = CuttingProxy(api_port, work / "cut-next-submit")
    model = work / "model.hlo.pb"
    model.write_bytes(HLO_MODEL)
    uri = cluster.upload(HLO_MODEL, "model.hlo.pb")
    specs = {
        "SPEC_OK": cluster.hlo_spec("ok", uri=uri),
        "SPEC_FAILS": {**cluster.hlo_spec("ncc-error", uri=uri), "buckets": [{"batch_size": 1, "seq_len": 16}]},
        "SPEC_INVALID": {"target": "cpu", "buckets": []},
        "SPEC_CUT": {**cluster.hlo_spec("ok", uri=uri), "model": {"uri": uri, "format": "hlo", "name": "cut-model"},
                     "buckets": [{"batch_size": 1, "seq_len": 48}]},  # a new build, not a hit
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPILESVC_", "AWS_"))}
    env.update({"COMPILESVC_API_URL": f"http://127.0.0.1:{proxy.port}", "COMPILESVC_TOKEN": BOOTSTRAP_TOKEN,
                "COMPILESVC_CONFIG": str(work / "no-config.toml"), "MODEL": str(model), "WORK": str(work),
                "CUT_FLAG": str(work / "cut-next-submit"), "API_DOWN_URL": f"http://127.0.0.1:{free_port()}",
                "EXPECTED_CODE": coded("NCC_EOOM001", RELEASES[NEURON_SDK]),
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"})
    for name, spec in specs.items():
        path = work / f"{name.lower()}.json"
        path.write_text(json.dumps(spec))
        env[name] = str(path)
    try:
        run = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=400)
    finally:
        proxy.close()
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}"
    assert proxy.cuts == 1
    with cluster.services.sessions() as session:
        submitters = {build.submitted_by for build in session.query(Build)}
    assert submitters == {"ci-vision"}  # every build is the pipeline token's owner's


def test_the_documented_retry_wrapper_retries_only_exit_3_and_keeps_every_status(make_cluster: MakeCluster,
                                                                                 tmp_path: Path) -> None:
    # Seen: "… && break; [ $? = 3 ] || exit $?" turned three exit-3s into a green job, and a 2 into a 1.
    wrapper = doc_block("ci.md", "To retry only infrastructure failures")
    cluster = make_cluster()
    base = cluster.client_env(cluster.start_service(concurrency=1), tmp_path)
    uri = cluster.upload(HLO_MODEL, "model.hlo.pb")
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "sleep").write_text('#!/bin/sh\necho "$@" >> "$SLEPT"\n')  # the wrapper's 60 s waits, recorded
    (shims / "sleep").chmod(0o755)
    base["PATH"] = f"{shims}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{base.get('PATH', '')}"

    def job(name: str, spec: dict[str, object]) -> tuple[int, str, list[str]]:
        work = tmp_path / name
        work.mkdir()
        (work / "spec.yaml").write_text(json.dumps(spec))  # JSON is YAML
        env = {**base, "GITHUB_OUTPUT": str(work / "output"), "SLEPT": str(work / "slept")}
        # GitHub runs a `run:` step as `bash --noprofile --norc -eo pipefail {0}`.
        run = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", wrapper], env=env,
                             cwd=work, capture_output=True, text=True, timeout=300)
        slept = (work / "slept").read_text().split() if (work / "slept").exists() else []
        output = (work / "output").read_text() if (work / "output").exists() else ""
        return run.returncode, output, slept

    status, output, slept = job("built", cluster.hlo_spec("ok", uri=uri))
    assert (status, slept) == (0, []) and re.fullmatch(r"key=[0-9a-f]{64}\n", output), output
    assert job("invalid", {"target": "cpu", "buckets": []}) == (2, "", [])  # not retried, and still a 2
    assert job("fails", cluster.hlo_spec("ncc-error", uri=uri))[:2] == (1, "")
    # No live worker serves this SDK release: the service refuses with exit 3 at once, three times.
    status, output, slept = job("no-worker", {**cluster.hlo_spec("ok", uri=uri), "sdk": "2.26.1"})
    assert (status, output, slept) == (3, "", ["60", "60"])


def test_the_cli_says_what_happened_and_what_to_do_next(make_cluster: MakeCluster, tmp_path: Path) -> None:
    # Seen: `status` of a finished build printed only the key and of a cancelled one "error: build 4 cancelled";
    # a hit's --json had "buckets": []; reused buckets "succeeded in 5.0 s"; no token: "send an HTTP header".
    cluster = make_cluster()
    env = cluster.client_env(cluster.start_service(), tmp_path)
    uri = cluster.upload(HLO_MODEL, "model.hlo.pb")

    def cli(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(Path(sys.executable).with_name("compilesvc")), *args], env={**env, **extra},
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)

    def spec(name: str, document: dict[str, object]) -> str:
        (tmp_path / name).write_text(json.dumps(document))
        return name

    ok = spec("ok.json", cluster.hlo_spec("ok", buckets=2, uri=uri))
    built = cli("submit", ok, "--poll", "0.3")
    assert built.returncode == 0, built.stderr
    key = built.stdout.strip()
    status = cli("status", "1")
    assert status.returncode == 0, status.stderr
    assert f"artifact {key} (published)" in status.stdout
    assert len(re.findall(r"^  bucket \d \(input_ids: .*\): succeeded in \d+\.\d s$", status.stdout, re.M)) == 2

    hit = cli("submit", ok, "--json")
    assert hit.returncode == 0, hit.stderr
    assert re.findall(r"^bucket \d \(.*\): succeeded \(reused from build 1\)$", hit.stderr, re.M), hit.stderr
    doc = json.loads(hit.stdout)
    assert doc["outcome"] == "hit" and [b["state"] for b in doc["buckets"]] == ["succeeded", "succeeded"]
    assert {(b["origin"]["how"], b["origin"]["from_build"]) for b in doc["buckets"]} == {("reused", 1)}

    slow = spec("slow.json", cluster.hlo_spec("slow:60", uri=uri))
    queued = cli("submit", slow, "--no-wait")
    assert queued.returncode == 0, queued.stderr
    build_id = queued.stdout.strip()
    assert cli("cancel", build_id).returncode == 0
    # A compile already running is stopped by its worker: until then its line says so, then it reads cancelled.
    deadline = time.monotonic() + 60
    while True:
        cancelled = cli("status", build_id)
        assert cancelled.returncode == 4, cancelled.stderr
        assert f"build {build_id} cancelled" in cancelled.stdout
        running = re.findall(r"^  bucket 0 \(.*\): running on .*$", cancelled.stdout, re.M)
        assert all(line.endswith("(cancelled, stopping)") for line in running), cancelled.stdout
        if not running or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert re.search(r"^  bucket 0 \(.*\): cancelled$", cancelled.stdout, re.M), cancelled.stdout
    assert cancelled.stderr.strip() == (f"error: build {build_id} was cancelled: `compilesvc retry {build_id}` "
                                        "builds its cancelled compiles again")

    no_token = cli("status", "1", COMPILESVC_TOKEN="")
    assert no_token.returncode == 2
    assert no_token.stderr.startswith("error: no API token: set COMPILESVC_TOKEN") and "Authorization" not in \
        no_token.stderr
    missing = {**cluster.hlo_spec("ok", uri=uri), "model": {"uri": f"blob:sha256:{'1' * 64}", "format": "hlo"}}
    never_uploaded = cli("submit", spec("missing.json", missing))
    assert never_uploaded.returncode == 2
    assert never_uploaded.stderr.count("is not uploaded") == 1 and "compilesvc upload FILE" in never_uploaded.stderr
