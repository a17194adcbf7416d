"""``compilesvc tokens create|list|revoke --ledger``: the first admin token of a deployment, made
straight in the ledger; and the command's errors (one line, exit 2 for bad input)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from compilesvc.access.tokens import authenticate
from compilesvc.cli.main import main
from compilesvc.cli.tokens import parse_duration
from compilesvc.ledger.engine import make_engine, make_sessionmaker


@pytest.fixture
def runner(tmp_path: Path, ledger_url: str, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.setenv("COMPILESVC_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("COMPILESVC_DATABASE_URL", ledger_url)
    return CliRunner()


def test_create_list_revoke_in_the_ledger(runner: CliRunner, ledger_url: str) -> None:
    made = runner.invoke(main, ["tokens", "create", "--ledger", "--name", "ops", "--owner", "alice",
                                "--scope", "admin", "--expires-in", "30d"])
    assert made.exit_code == 0, made.output
    secret = made.stdout.strip()
    assert secret.startswith("csvc_") and "shown only now" in made.stderr
    engine = make_engine(ledger_url)
    try:
        with make_sessionmaker(engine)() as session:
            principal = authenticate(session, secret)
            assert principal is not None and principal.owner == "alice" and principal.team == "alice"
            assert principal.expires_at is not None
    finally:
        engine.dispose()
    fleet = runner.invoke(main, ["tokens", "create", "--ledger", "--name", "fleet", "--owner", "serving",
                                 "--scope", "fleet", "--json"])
    assert fleet.exit_code == 0 and '"scopes": [\n  "fleet"\n ]' in fleet.stdout

    listed = runner.invoke(main, ["tokens", "list", "--ledger"])
    assert listed.exit_code == 0 and "alice" in listed.stdout and "serving" in listed.stdout
    assert secret not in listed.stdout and secret[:9] in listed.stdout

    revoked = runner.invoke(main, ["tokens", "revoke", "--ledger", "1"])
    assert revoked.exit_code == 0 and "revoked at" in revoked.stdout
    assert "alice" not in runner.invoke(main, ["tokens", "list", "--ledger"]).stdout
    assert "alice" in runner.invoke(main, ["tokens", "list", "--ledger", "--all"]).stdout


@pytest.mark.parametrize(("argv", "message"), [
    (["--scope", "root"], "unknown scope 'root'"),
    (["--scope", "fleet,read"], "fleet scope only"),
    (["--scope", "read", "--expires-in", "soon"], "expected a positive number"),
])
def test_bad_input_is_one_line_and_exit_2(runner: CliRunner, argv: list[str], message: str) -> None:
    result = runner.invoke(main, ["tokens", "create", "--ledger", "--name", "x", "--owner", "o", *argv])
    assert result.exit_code == 2 and message in result.stderr and result.stderr.count("\n") == 1, result.output
    missing = runner.invoke(main, ["tokens", "revoke", "--ledger", "42"])
    assert missing.exit_code == 2 and "no token 42" in missing.stderr


def test_durations() -> None:
    assert [parse_duration(t) for t in ("90d", "12h", "30m", "3600", "2w")] == [7776000, 43200, 1800, 3600, 1209600]
