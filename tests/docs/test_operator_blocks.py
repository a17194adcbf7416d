"""An operator's blocks of docs/deploy.md, docs/security.md and docs/fleet.md, run as written: the signing key
made with the documented openssl commands signs what the service publishes; sign-artifacts, gc, pins,
tokens and a roll-forward run against a real service (server commands with the service's settings, client
ones with an admin token). Placeholders (a key, an id) are replaced by :func:`fill`."""

from __future__ import annotations

import re
from pathlib import Path

from compilesvc.signing.keys import SigningKey
from tests.docs.conftest import MakeCluster, Shell
from tests.fixtures.docs import doc_block, fill
from tests.fixtures.tokens import BOOTSTRAP_TOKEN


def lines(block: str) -> list[str]:
    """A block's commands, one per line (the blocks here continue no line)."""
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_operator_blocks(make_cluster: MakeCluster, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    Shell({}, keys).run(doc_block("deploy.md", "Make a key and hand its public half"))
    assert (keys / "signing-key.pem").stat().st_mode & 0o777 == 0o600
    assert SigningKey.load(keys / "signing-key.pem").key_id  # the service takes the key as made
    cluster = make_cluster(signing_key_file=str(keys / "signing-key.pem"))
    port = cluster.start_service()
    built = cluster.submit(cluster.hlo_spec("ok"))
    key = built.artifact_key
    cluster.wait_artifact(key, ("published",))
    # Server commands: the service's settings (COMPILESVC_DATABASE_URL, the store, the key).
    server = Shell(cluster.env, tmp_path)
    client = {"COMPILESVC_API_URL": f"http://127.0.0.1:{port}", "COMPILESVC_TOKEN": BOOTSTRAP_TOKEN,
              "COMPILESVC_CONFIG": str(tmp_path / "no-config.toml")}

    signed = server.run(doc_block("deploy.md", "On a host with the service's settings and key"))
    assert "error" not in signed.stderr.lower(), signed.stderr
    gc = server.run(doc_block("deploy.md", "(a cron job or Kubernetes CronJob with the API's environment)"))
    assert gc.stdout, gc.stderr

    pins = fill(doc_block("deploy.md", "Pins keep artifacts whatever the policy says"),
                {"--artifact KEY": f"--artifact {key}"})
    *adds, listing, remove = lines(pins)
    client_shell = Shell(client, tmp_path)
    client_shell.run("\n".join(adds))
    listed = client_shell.run(listing).stdout
    assert key in listed and "bert-large" in listed and "fleet:search" in listed, listed
    pin_id = re.findall(r"^\s*(\d+)\b", listed, re.M)[0]
    client_shell.run(fill(remove, {"ID": pin_id}))
    assert len(re.findall(r"^\s*\d+\b", client_shell.run(listing).stdout, re.M)) == 2

    tokens = fill(doc_block("security.md", "Making tokens:"), {"[--all]": "--all", "revoke 7": "revoke 2"})
    made = Shell({**cluster.env, **client}, tmp_path).run(tokens)
    assert made.stdout.count("csvc_") >= 3, made.stdout
    Shell(client, tmp_path).run(doc_block("security.md", "give each team's fleet a token of that team"))

    rollforward = doc_block("fleet.md", "An operator (an `admin` token) runs:")
    dry_run = lines(rollforward)[0]
    assert dry_run.split("#")[0].strip().endswith("--dry-run")
    assert client_shell.run(dry_run).stdout
