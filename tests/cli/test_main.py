"""The installed ``compilesvc`` console script, run as a real subprocess."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, inspect

from compilesvc.hostinfo import host_isa
from compilesvc.spec.keys import KEY_SCHEMA, compute_keys
from compilesvc.spec.parsing import parse_spec

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
TINY_JSON = EXAMPLES / "tiny-bert" / "spec.json"
TINY_YAML = EXAMPLES / "tiny-bert" / "spec.yaml"
LLAMA_JSON = EXAMPLES / "inf2-llama" / "spec.json"
CLI = Path(sys.executable).parent / "compilesvc"
HEX64_RE = re.compile(r"^[0-9a-f]{64}$")


def clean_env(tmp: Path, **extra: str) -> dict[str, str]:
    """The caller's environment without COMPILESVC_* settings, with state kept under ``tmp``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILESVC_")}
    env["COMPILESVC_DATA_DIR"] = str(tmp / "data")
    env.update(extra)
    return env


@pytest.fixture
def run(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    def _run(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(CLI), *map(str, args)],
            env=env if env is not None else clean_env(tmp_path),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )

    return _run


Run = Callable[..., subprocess.CompletedProcess[str]]


ExampleKey = Callable[..., str]


@pytest.fixture(scope="module")
def example_key(tmp_path_factory: pytest.TempPathFactory) -> ExampleKey:
    """``compilesvc key ARGS…`` in a clean environment, run once per distinct ARGS in this module.

    Every call of the console script costs a fresh interpreter; these invocations are deterministic, so the
    suite stays fast by not repeating them.
    """
    home = tmp_path_factory.mktemp("example-keys")

    @functools.cache
    def _key(*args: str) -> str:
        result = subprocess.run(
            [str(CLI), "key", *args], env=clean_env(home), cwd=home, capture_output=True, text=True, timeout=60
        )
        return key_of(result)

    return lambda *args: _key(*map(str, args))


def key_of(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    assert len(lines) == 1 and HEX64_RE.match(lines[0]), result.stdout
    return lines[0]


def write_spec(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(json.dumps(doc))
    return path


def tiny_doc() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(TINY_JSON.read_text())
    return doc


def aot_doc() -> dict[str, Any]:
    doc = tiny_doc()
    doc["compiler"] = {"backend": "aotinductor", "args": ["--max-autotune"]}
    return doc


# --- keys -------------------------------------------------------------------------------------------------


def test_console_script_is_installed() -> None:
    assert CLI.exists(), f"{CLI} missing: pip install -e '.[cpu,dev]'"


def test_key_prints_the_artifact_key(example_key: ExampleKey) -> None:
    printed = example_key(TINY_JSON)
    doc = tiny_doc()
    sha = doc["model"]["uri"].removeprefix("blob:sha256:")
    assert printed == compute_keys(parse_spec(doc), model_sha256=sha, default_isa=host_isa()).key


def test_json_and_yaml_specs_give_the_same_key(example_key: ExampleKey) -> None:
    assert example_key(TINY_JSON) == example_key(TINY_YAML)


def test_examples_have_pinned_keys(example_key: ExampleKey) -> None:
    # The examples are golden cases too (tests/golden/keys.json); the CLI must agree with them.
    golden = {c["name"]: c["key"] for c in json.loads((REPO / "tests/golden/keys.json").read_text())["cases"]}
    assert example_key(TINY_JSON) == golden["cpu-torchscript-shorthand (examples/tiny-bert)"]
    assert example_key(LLAMA_JSON) == golden["inf2-trace-tp2 (examples/inf2-llama)"]


def test_same_key_under_different_hash_seeds(run: Run, tmp_path: Path) -> None:
    keys = {key_of(run("key", LLAMA_JSON, env=clean_env(tmp_path, PYTHONHASHSEED=seed))) for seed in ("0", "999")}
    assert len(keys) == 1


def test_bucket_order_in_the_file_does_not_matter(example_key: ExampleKey, run: Run, tmp_path: Path) -> None:
    doc = json.loads(LLAMA_JSON.read_text())
    doc["buckets"].reverse()
    reversed_spec = write_spec(tmp_path / "reversed.json", doc)
    assert key_of(run("key", reversed_spec)) == example_key(LLAMA_JSON)


def test_sdk_change_changes_the_key(example_key: ExampleKey, run: Run, tmp_path: Path) -> None:
    doc = json.loads(LLAMA_JSON.read_text())
    doc["sdk"] = "2.21.0"
    assert key_of(run("key", write_spec(tmp_path / "sdk.json", doc))) != example_key(LLAMA_JSON)


def test_salt_option_and_setting(example_key: ExampleKey, run: Run, tmp_path: Path) -> None:
    plain = example_key(TINY_JSON)
    salted = key_of(run("key", TINY_JSON, "--salt", "incident-7"))
    from_env = key_of(run("key", TINY_JSON, env=clean_env(tmp_path, COMPILESVC_KEY_SALT="incident-7")))
    assert salted != plain
    assert salted == from_env
    # An explicit --salt wins over the setting (explaining a key computed elsewhere).
    overridden = run("key", TINY_JSON, "--salt", "", env=clean_env(tmp_path, COMPILESVC_KEY_SALT="incident-7"))
    assert key_of(overridden) == plain


def test_isa_defaults_to_the_host_and_matters_for_aotinductor(run: Run, tmp_path: Path) -> None:
    # (That the isa is left out of other backends' keys is a property in test_keys.)
    aot = write_spec(tmp_path / "aot.json", aot_doc())
    other = "aarch64-sve" if host_isa() != "aarch64-sve" else "x86_64-avx2"
    default = key_of(run("key", aot))
    assert default == key_of(run("key", aot, "--isa", host_isa()))
    assert default != key_of(run("key", aot, "--isa", other))


def test_file_model_is_hashed(run: Run, tmp_path: Path) -> None:
    model = tmp_path / "model dir" / "model.pt2"
    model.parent.mkdir()
    model.write_bytes(os.urandom(300_000))
    doc = tiny_doc()
    doc["model"]["uri"] = model.as_uri()  # percent-encodes the space
    by_file = key_of(run("key", write_spec(tmp_path / "file.json", doc)))
    doc["model"]["uri"] = f"blob:sha256:{hashlib.sha256(model.read_bytes()).hexdigest()}"
    assert by_file == key_of(run("key", write_spec(tmp_path / "blob.json", doc)))


def test_file_model_digest_matches_the_service(tmp_path: Path) -> None:
    # The CLI hashes file:// models itself; the service pins them through model_identity. One content,
    # one digest, or a key explained on a laptop never matches the key the service computed.
    model_identity = pytest.importorskip("compilesvc.pinning.identity")
    from compilesvc.config.settings import Settings

    model = tmp_path / "model.pt"
    model.write_bytes(b"weights" * 1000)
    doc = tiny_doc()
    doc["model"]["uri"] = model.as_uri()
    spec = parse_spec(doc)
    from compilesvc.cli.main import model_sha256

    service = model_identity.content_sha256_for_key(spec.model, Settings(data_dir=tmp_path / "data"))
    assert model_sha256(spec) == service == hashlib.sha256(model.read_bytes()).hexdigest()


def test_json_output(example_key: ExampleKey, run: Run) -> None:
    result = run("key", "--json", LLAMA_JSON)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert set(data) == {"key", "schema", "buckets", "components"}
    assert data["key"] == example_key(LLAMA_JSON)
    assert data["schema"] == KEY_SCHEMA
    assert len(data["buckets"]) == 3
    for bucket in data["buckets"]:
        assert set(bucket) == {"key", "inputs"} and HEX64_RE.match(bucket["key"])
        assert [i["name"] for i in bucket["inputs"]] == ["input_ids", "attention_mask", "position_ids"]
    assert data["buckets"][0]["inputs"][0] == {"name": "input_ids", "shape": [1, 128], "dtype": "int64"}
    assert set(data["components"]) == {"schema", "salt", "model", "toolchain", "flags", "buckets"}


def test_explain_output(example_key: ExampleKey, run: Run) -> None:
    result = run("key", "--explain", LLAMA_JSON)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    key = example_key(LLAMA_JSON)
    assert lines[0] == f"artifact key  {key}"
    for name in ("schema", "salt", "model", "toolchain", "flags", "buckets"):
        assert any(line.startswith(name) for line in lines), name
    text = result.stdout
    assert KEY_SCHEMA in text
    # The spec's sdk 2.20.0 as the exact toolchain it resolves to (compilesvc/neuron_releases.json).
    assert '"tp_degree": 2' in text and '"neuronx-cc": "2.15.128.0"' in text
    assert '"torch-neuronx": "2.1.2.2.3.0"' in text
    # Canonical flags: --logfile is gone, spellings are unified.
    assert '["--auto-cast=matmult", "--model-type=transformer", "-O1"]' in text and "logfile" not in text
    assert sum(line.lstrip().startswith("bucket[") for line in lines) == 3


# --- errors -----------------------------------------------------------------------------------------------


def _bad_files(tmp: Path) -> dict[str, tuple[list[str], str, int]]:
    """name -> (arguments, expected fragment of the one error line, exit status)."""
    (tmp / "bad.json").write_text('{"model": ')
    (tmp / "bad.yaml").write_text("model: [\n  a: b\n")
    (tmp / "list.json").write_text("[1, 2]")
    (tmp / "binary.json").write_bytes(b"\xff\xfe\x00\x01")
    unknown = tiny_doc() | {"colour": "blue"}
    (tmp / "unknown.json").write_text(json.dumps(unknown))
    many = tiny_doc() | {"target": "inf9", "sdk": "latest", "colour": "blue"}
    (tmp / "many.json").write_text(json.dumps(many))
    cpu_tp = tiny_doc()
    cpu_tp["compiler"]["tp_degree"] = 2
    (tmp / "cpu_tp.json").write_text(json.dumps(cpu_tp))
    missing_model = tiny_doc()
    missing_model["model"]["uri"] = "file:///nonexistent/dir/model.pt2"
    (tmp / "missing_model.json").write_text(json.dumps(missing_model))
    dir_model = tiny_doc()
    dir_model["model"]["uri"] = tmp.as_uri()
    (tmp / "dir_model.json").write_text(json.dumps(dir_model))
    huge = tiny_doc()
    huge["buckets"].append({"inputs": [{"name": "x", "shape": [1048576] * 8, "dtype": "float32"}]})
    (tmp / "huge.json").write_text(json.dumps(huge))
    return {
        "missing spec file": (["key", "absent.json"], "cannot read absent.json: No such file or directory", 2),
        "spec is a directory": (["key", str(tmp)], "is a directory", 2),
        "invalid JSON": (["key", "bad.json"], "bad.json is not valid JSON", 2),
        "invalid YAML": (["key", "bad.yaml"], "bad.yaml is not valid YAML", 2),
        "not an object": (["key", "list.json"], "list.json: expected a JSON object", 2),
        "not UTF-8": (["key", "binary.json"], "binary.json is not UTF-8 text", 2),
        "unknown field": (["key", "unknown.json"], "unknown.json: colour: unknown field", 2),
        "several errors": (["key", "many.json"], "target: Input should be", 2),
        "cross-field error": (["key", "cpu_tp.json"], "compiler.tp_degree: must be 1 for target cpu", 2),
        "missing model file": (["key", "missing_model.json"],
                               "cannot read model file: /nonexistent/dir/model.pt2 does not exist", 1),
        "model is a directory": (["key", "dir_model.json"], "cannot read model file", 1),
        "missing argument": (["key"], "Missing argument 'SPEC'", 2),
        "bad --isa": (["key", "--isa", "avx512", str(TINY_JSON)], "Invalid value for '--isa'", 2),
        "--json with --explain": (["key", "--json", "--explain", str(TINY_JSON)], "exclude each other", 2),
        "unknown option": (["key", "--colour", str(TINY_JSON)], "No such option '--colour'", 2),
        "unknown command": (["frobnicate"], "No such command 'frobnicate'", 2),
        "upload of a missing file": (["upload", "absent.pt2"], "Path 'absent.pt2' does not exist", 2),
        "impossible shape": (["key", "huge.json"], f"shape: {1048576**8} elements per input; at most {2**34}", 2),
        "fetch of a bad key": (["fetch", "KEY", "--dest", "out"], "'KEY' is not an artifact key", 2),
        "fetch into a non-empty directory": (["fetch", "0" * 64, "--dest", "."], "is not empty", 2),
        "bad database url": (["migrate", "--database-url", "nosuchdb://x"], "Invalid value for '--database-url'", 2),
        "unreachable database": (
            ["migrate", "--database-url", "postgresql+psycopg://u@127.0.0.1:1/x?connect_timeout=2"],
            "migration failed: OperationalError",
            1,
        ),
    }


# The keys of _bad_files (which needs a directory to write into); test_every_error_case_is_listed keeps them in step.
ERROR_CASES = [
    "missing spec file", "spec is a directory", "invalid JSON", "invalid YAML", "not an object", "not UTF-8",
    "unknown field", "several errors", "cross-field error", "missing model file", "model is a directory",
    "missing argument", "bad --isa", "--json with --explain", "unknown option", "unknown command",
    "upload of a missing file", "impossible shape", "fetch of a bad key", "fetch into a non-empty directory",
    "bad database url", "unreachable database",
]


@pytest.fixture(scope="module")
def error_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, subprocess.CompletedProcess[str]]]:
    """Every error case, run concurrently once (each is a fresh interpreter)."""
    tmp = tmp_path_factory.mktemp("errors")
    cases = _bad_files(tmp)
    procs = {
        name: subprocess.Popen(
            [str(CLI), *args], env=clean_env(tmp), cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name, (args, _, _) in cases.items()
    }
    results = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    yield results


@pytest.mark.parametrize("case", ERROR_CASES)
def test_errors_are_one_line(error_runs: dict[str, subprocess.CompletedProcess[str]], tmp_path: Path,
                             case: str) -> None:
    _, fragment, status = _bad_files(tmp_path)[case]
    result = error_runs[case]
    assert result.returncode == status, (result.returncode, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and fragment in lines[0], lines[0]
    assert "Traceback" not in result.stderr


def test_every_error_case_is_listed(tmp_path: Path) -> None:
    assert sorted(_bad_files(tmp_path)) == sorted(ERROR_CASES)


def test_several_spec_errors_share_the_line(error_runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    line = error_runs["several errors"].stderr.strip()
    assert "target:" in line and "sdk:" in line and "colour: unknown field" in line


# --- migrate, version, plugins ------------------------------------------------------------------------------


def test_migrate_creates_the_tables(run: Run, tmp_path: Path) -> None:
    db = tmp_path / "new dir" / "ledger.db"
    url = f"sqlite:///{db}"
    result = run("migrate", "--database-url", url)
    assert result.returncode == 0, result.stderr
    assert "migrated" in result.stdout
    engine = create_engine(url)
    try:
        tables = set(inspect(engine).get_table_names())
    finally:
        engine.dispose()
    assert {"alembic_version", "artifacts", "bucket_compiles", "builds"} <= tables


def test_migrate_defaults_to_the_settings_database(run: Run, tmp_path: Path) -> None:
    # COMPILESVC_DATA_DIR does not exist yet: embedded mode on a fresh checkout. Running it twice is harmless.
    for _ in range(2):
        result = run("migrate")
        assert result.returncode == 0, result.stderr
    assert (tmp_path / "data" / "compilesvc.db").exists()


def test_version(run: Run) -> None:
    result = run("version")
    assert result.returncode == 0
    assert re.match(rf"^compilesvc \d+\.\d+\.\d+\S* \(key schema {re.escape(KEY_SCHEMA)}\)$", result.stdout.strip())


def _fake_plugin_dist(root: Path) -> None:
    """A distribution on PYTHONPATH that registers a working, a broken and a bogus subcommand."""
    (root / "fake_plugin.py").write_text(
        "import click\n\n"
        "@click.command()\n"
        "def hello() -> None:\n"
        '    """Say hello."""\n'
        '    click.echo("hello from a plugin")\n\n'
        "not_a_command = 42\n"
    )
    dist = root / "fake_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[compilesvc.commands]\n"
        "hello = fake_plugin:hello\n"
        "broken = no_such_module_for_compilesvc:cmd\n"
        "bogus = fake_plugin:not_a_command\n"
    )


def test_plugin_commands_load_from_entry_points(run: Run, tmp_path: Path) -> None:
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    _fake_plugin_dist(plugins)
    env = clean_env(tmp_path, PYTHONPATH=str(plugins))

    hello = run("hello", env=env)
    assert hello.returncode == 0, hello.stderr
    assert hello.stdout == "hello from a plugin\n" and hello.stderr == ""

    # A bare `compilesvc` shows the help with every command, not an error line (click >= 8.2 exits 2 for it
    # and writes the help to stderr). Listing imports every plugin, the real ones too: one listing only.
    listing = run(env=env)
    assert listing.returncode in (0, 2)
    assert "error:" not in listing.stderr
    help_text = listing.stdout + listing.stderr
    assert "Usage: compilesvc" in help_text
    for name in ("key", "migrate", "version"):
        assert re.search(rf"^\s+{name}\s", help_text, re.M), name
    assert re.search(r"^\s+hello\s+Say hello", help_text, re.M)
    warnings = [line for line in listing.stderr.splitlines() if "no_such_module_for_compilesvc" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: skipping command 'broken'")
    assert any(line.startswith("warning: skipping command 'bogus'") for line in listing.stderr.splitlines())
    assert "Traceback" not in listing.stderr

    broken = run("broken", env=env)
    assert broken.returncode == 2
    assert broken.stderr.splitlines()[-1].startswith("error: No such command 'broken'")

    # Core commands never import plugins: no warning, however broken they are.
    key = run("key", TINY_JSON, env=env)
    assert key.returncode == 0 and key.stderr == ""


def test_core_never_imports_web_or_workers() -> None:
    pattern = re.compile(r"^\s*(from|import)\s+(web|workers)\b", re.M)
    offenders = [p for p in (REPO / "compilesvc").rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


@pytest.mark.parametrize("command", [("gc", "--dry-run"), ("tokens", "list", "--ledger"), ("sign-artifacts", "--all")])
def test_a_ledger_command_outside_a_dev_directory_says_where_to_run_and_creates_nothing(
        run: Run, tmp_path: Path, command: tuple[str, ...]) -> None:
    # Seen: `gc --dry-run` made ./.compilesvc and died on a raw "no such table: gc_runs".
    result = run(*command)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: no ledger at ") and "COMPILESVC_DATABASE_URL" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "data").exists()  # COMPILESVC_DATA_DIR (clean_env): nothing made


def test_a_ledger_without_tables_is_refused_with_the_migrate_command(run: Run, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    result = run("gc", "--dry-run", env=clean_env(tmp_path, COMPILESVC_DATABASE_URL=url))
    assert result.returncode == 2, result.stderr
    assert "has no tables: run `compilesvc migrate`" in result.stderr
    assert inspect(create_engine(url)).get_table_names() == []


def test_explain_shows_the_resolved_lnc(tmp_path: Path, run: Run) -> None:
    # Issue 28 (5): the logical NeuronCore config is resolved at submit; --explain shows it on its own line.
    spec = {"model": {"uri": "blob:sha256:" + "a" * 64, "format": "hlo"}, "target": "trn3", "sdk": "2.29.0",
            "buckets": [{"batch_size": 1, "seq_len": 16}]}
    omitted, written = tmp_path / "omitted.json", tmp_path / "written.json"
    omitted.write_text(json.dumps(spec))
    written.write_text(json.dumps({**spec, "compiler": {"args": ["--lnc", "2"]}}))
    outputs = []
    for path in (omitted, written):
        result = run("key", "--explain", path)
        assert result.returncode == 0, result.stderr
        outputs.append(result.stdout)
        assert "  lnc         2  (logical NeuronCores, resolved at submit: trn3's default;" in result.stdout
        assert '"lnc": 2' in result.stdout and '"target": "trn3"' in result.stdout
    assert outputs[0] == outputs[1]  # the default written out is the same key, component by component
