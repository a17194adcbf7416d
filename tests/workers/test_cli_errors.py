"""Every client command's refusal is one ``error:`` line that names what to do next, with the exit status
docs/ci.md (build commands) and docs/fleet.md (fetch, verify) give: the real CLI against a real service."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from tests.fixtures.tokens import make_token
from tests.workers.conftest import HLO_MODEL, Cluster

MakeCluster = Callable[..., Cluster]
COMPILESVC = str(Path(sys.executable).with_name("compilesvc"))
UNKNOWN_KEY = "ab" * 32


def test_each_refusal_names_the_next_step(make_cluster: MakeCluster, tmp_path: Path) -> None:
    cluster = make_cluster()
    env = cluster.client_env(cluster.start_service(), tmp_path)
    uri = cluster.upload(HLO_MODEL, "model.hlo.pb")
    done = cluster.submit(cluster.hlo_spec("ok", uri=uri))
    cluster.wait_artifact(done.artifact_key, ("published",))
    no_model = {**cluster.hlo_spec("ok", uri=uri), "model": {"uri": f"blob:sha256:{UNKNOWN_KEY}", "format": "hlo"}}
    (tmp_path / "no-model.json").write_text(json.dumps(no_model))
    (tmp_path / "ok.json").write_text(json.dumps(cluster.hlo_spec("ok", uri=uri)))
    # No COMPILESVC_MODEL_S3_PREFIXES: no team may name an S3 model (refused before S3 is asked: there is none).
    theirs = {**no_model, "model": {"uri": "s3://another-teams-models/model.hlo.pb", "format": "hlo"}}
    (tmp_path / "s3-model.json").write_text(json.dumps(theirs))
    fleet_token = make_token(cluster.services.sessions, "fleet")

    cases: list[tuple[list[str], dict[str, str], int, str]] = [
        (["status", "999"], {}, 2, "`compilesvc builds` lists them"),
        (["cancel", str(done.build_id)], {}, 2, "nothing to cancel"),
        (["retry", str(done.build_id)], {}, 2, "`compilesvc status ID` shows its buckets"),
        (["submit", "no-model.json"], {}, 2, "compilesvc upload FILE"),
        (["submit", "s3-model.json"], {}, 2, "the prefixes each team may name in COMPILESVC_MODEL_S3_PREFIXES"),
        (["submit", "ok.json"], {"COMPILESVC_TOKEN": fleet_token}, 2, "use a token with the submit scope"),
        (["fetch", UNKNOWN_KEY], {}, 1, "submit the spec to build it"),
        (["fetch", "not-a-key"], {}, 2, "64 lowercase hex digits"),
        (["verify", "not-a-key-or-dir"], {}, 2, "nor a directory"),
        (["campaigns", "999"], {}, 2, "`compilesvc campaigns` lists them"),
        (["pins", "remove", "999"], {}, 2, "`compilesvc pins list`"),  # a 404: exit 2 (docs/ci.md)
        (["tokens", "revoke", "999"], {}, 2, "`compilesvc tokens list --all`"),
        (["upload", "missing.pt2"], {}, 2, "see 'compilesvc upload --help'"),
    ]
    for argv, extra, status, action in cases:
        run = subprocess.run([COMPILESVC, *argv], env={**env, **extra}, cwd=tmp_path, capture_output=True,
                             text=True, timeout=120)
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (argv, run.stderr)
        assert action in lines[0] and run.returncode == status, (argv, run.returncode, run.stderr)
        assert lines[0].count("compilesvc upload FILE") <= 1, lines[0]  # the API's own step is not said twice
