"""docker-compose.yml and the images: valid against the Compose Specification, and wired the way the service
needs (migrations before everything, a broker that never evicts, Neuron workers behind a profile, settings
that exist). No Docker engine needed: the file is read as YAML, with compose's ${VAR:-default}
interpolation emulated using the defaults (an empty environment).

The schema is the Compose Specification's own, vendored in tests/data/ (see tests/data/README.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from compilesvc.config.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
SCHEMA_FILE = ROOT / "tests" / "data" / "compose-spec.json"
ENV_EXAMPLE = ROOT / "docker" / "env.example"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
DOCKERFILE_NEURON = ROOT / "docker" / "Dockerfile.neuron"
DEPLOY_DOC = ROOT / "docs" / "deploy.md"
NGINX_TEMPLATE = ROOT / "docker" / "nginx" / "compilesvc.conf.template"

ENV_PREFIX = "COMPILESVC_"
#: COMPILESVC_* variables read directly from the environment rather than through Settings (each must
#: still appear in the code that reads it: see test_environment_names_are_real).
PROCESS_ENV = {
    "COMPILESVC_NEURON_SDK",  # workers/host/versions.py: the host's Neuron SDK release
    "COMPILESVC_NEURON_TARGETS",  # workers/host/capabilities.py
    "COMPILESVC_LOG_LEVEL",  # compilesvc/jsonlog.py
}
#: Services that run compilesvc long-term: all wait for the migration.
LONG_RUNNING = ("api", "relay", "worker-cpu", "worker-neuron")
#: Services built from the compilesvc images.
COMPILESVC_SERVICES = ("s3-init", "migrate", *LONG_RUNNING)

_VAR_RE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable substitution (${VAR}, ${VAR:-default}, ${VAR-default}, $$), recursively."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1) or match.group(4)
        op, default = match.group(2), match.group(3) or ""
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env.get(name, default)
        if op in (":?", "?"):
            pytest.fail(f"${{{name}}} is required: docker compose config fails without a .env")
        return env.get(name, "")

    return _VAR_RE.sub(substitute, value)


def variables_used(text: str) -> set[str]:
    return {m.group(1) or m.group(4) for m in _VAR_RE.finditer(text) if m.group(0) != "$$"}


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def compose(raw: dict[str, Any]) -> dict[str, Any]:
    """The file as compose sees it with no .env: every ${VAR:-default} at its default."""
    resolved = interpolate(raw, {})
    assert isinstance(resolved, dict)
    return resolved


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def depends_on(service: dict[str, Any]) -> dict[str, dict[str, Any]]:
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return {name: {"condition": "service_started"} for name in deps}
    return deps


# -- the Compose Specification ---------------------------------------------------------------------------

def test_valid_against_the_compose_spec_schema(raw: dict[str, Any]) -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema belongs in the dev extra")
    schema = json.loads(SCHEMA_FILE.read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = sorted(validator.iter_errors(raw), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
                                 for e in errors)


def test_schema_rejects_what_it_should() -> None:
    """The vendored schema is the real one: it refuses an unknown service key and a bad condition."""
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema belongs in the dev extra")
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA_FILE.read_text()))
    assert not validator.is_valid({"services": {"a": {"image": "x", "imagee": "y"}}})
    assert not validator.is_valid({"services": {"a": {"image": "x", "depends_on": {"b": {"condition": "up"}}}}})
    assert validator.is_valid({"services": {"a": {"image": "x"}}, "x-anything": {"k": 1}})


def test_no_obsolete_version_and_no_required_variables(raw: dict[str, Any]) -> None:
    assert "version" not in raw  # obsolete in the Compose Specification; compose v2 warns about it
    text = COMPOSE_FILE.read_text()
    assert not re.search(r"\$\{[A-Za-z0-9_]+:?\?", text), "a ${VAR:?} makes `docker compose config` fail without .env"


@pytest.mark.parametrize("tool", [["docker", "compose"], ["docker-compose"]], ids=["compose-v2", "compose-v1"])
def test_compose_cli_accepts_the_file(tool: list[str]) -> None:
    """`docker compose config` (or docker-compose 1.29's), where installed: the implementation's own check."""
    if shutil.which(tool[0]) is None:
        pytest.skip(f"{tool[0]} is not installed")
    if tool == ["docker", "compose"]:
        probe = subprocess.run([*tool, "version"], capture_output=True, timeout=30)
        if probe.returncode != 0:
            pytest.skip("the docker compose plugin is not installed")
    for extra in ([], ["--env-file", str(ENV_EXAMPLE)]):
        proc = subprocess.run([*tool, "-f", str(COMPOSE_FILE), *extra, "--profile", "neuron", "config", "-q"],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr


# -- wiring ----------------------------------------------------------------------------------------------

def test_every_dependency_exists(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        for target in depends_on(service):
            assert target in services, f"{name} depends on {target}, which is not a service"
            assert target != name


def test_migrate_runs_once_before_everything_that_uses_the_ledger(services: dict[str, dict[str, Any]]) -> None:
    migrate = services["migrate"]
    assert migrate["command"] == ["migrate", "--grant-api", "compilesvc_api", "--grant-worker", "compilesvc_worker"]
    assert migrate.get("restart") == "no"
    assert depends_on(migrate)["postgres"]["condition"] == "service_healthy"
    for name in LONG_RUNNING:
        deps = depends_on(services[name])
        assert deps.get("migrate", {}).get("condition") == "service_completed_successfully", name


def test_bucket_exists_before_artifacts_are_touched(services: dict[str, dict[str, Any]]) -> None:
    init = services["s3-init"]
    assert init.get("restart") == "no"
    assert depends_on(init)["s3"]["condition"] == "service_healthy"
    assert "healthcheck" in services["s3"]
    for name in ("api", "worker-cpu", "worker-neuron"):
        assert depends_on(services[name])["s3-init"]["condition"] == "service_completed_successfully", name


def test_redis_is_a_broker_that_neither_evicts_nor_forgets(services: dict[str, dict[str, Any]]) -> None:
    redis = services["redis"]
    command = redis["command"]
    words = command if isinstance(command, list) else command.split()
    assert redis["image"].startswith("redis:7")
    assert words[words.index("--maxmemory-policy") + 1] == "noeviction"
    assert words[words.index("--appendonly") + 1] == "yes"
    assert any(v.startswith("redisdata:") for v in redis["volumes"])
    for name in LONG_RUNNING:
        assert depends_on(services[name])["redis"]["condition"] == "service_healthy", name


def test_postgres_has_a_healthcheck_and_a_volume(services: dict[str, dict[str, Any]]) -> None:
    postgres = services["postgres"]
    assert postgres["image"] == "postgres:15"
    assert "pg_isready" in postgres["healthcheck"]["test"]
    assert any(v.startswith("pgdata:/var/lib/postgresql/data") for v in postgres["volumes"])


def test_api_serves_on_8080_and_checks_readiness(services: dict[str, dict[str, Any]]) -> None:
    api = services["api"]
    assert api["command"] == ["serve", "--host", "0.0.0.0", "--port", "8080", "--workers", "4",
                              "--forwarded-allow-ips", "*"]
    assert "ports" not in api, "the API is reached through the proxy only"
    test = api["healthcheck"]["test"]
    assert test[0] == "CMD" and any("/readyz" in part for part in test)
    assert services["relay"]["command"] == ["relay"]
    assert services["worker-cpu"]["command"] == ["worker", "--concurrency", "2"]


def _published(service: dict[str, Any]) -> list[str]:
    return [p if isinstance(p, str) else f"{p.get('published')}:{p['target']}" for p in service.get("ports", [])]


def test_proxy_is_the_only_way_in(services: dict[str, dict[str, Any]]) -> None:
    """nginx (official image, pinned) fronts the API: the only published API port, its template mounted
    read-only, every template variable provided, body limits equal to the API's settings."""
    from tests.fixtures.nginx import template_variables

    proxy = services["proxy"]
    assert re.fullmatch(r"nginx:\d+\.\d+\.\d+(-alpine)?", proxy["image"]), "pin an exact nginx release"
    assert _published(proxy) == ["8080:8080"]
    assert [name for name, service in services.items() if any(p.endswith(":8080") for p in _published(service))] \
        == ["proxy"]
    mounts = proxy["volumes"]
    assert "./docker/nginx/compilesvc.conf.template:/etc/nginx/templates/default.conf.template:ro" in mounts
    assert any(v.startswith("proxy-tmp:/var/cache/nginx") for v in mounts)
    env = environment(proxy)
    variables = template_variables(NGINX_TEMPLATE.read_text())
    assert variables and variables <= set(env), f"the proxy lacks {sorted(variables - set(env))}"
    assert all(re.match(env["NGINX_ENVSUBST_FILTER"], name) for name in variables)
    assert env["NGINX_UPSTREAM_SERVER"].split()[0] == "api:8080"
    api_env = environment(services["api"])
    defaults = Settings.model_fields
    assert env["NGINX_MAX_UPLOAD_BYTES"] == api_env["COMPILESVC_MAX_UPLOAD_BYTES"] \
        == str(defaults["max_upload_bytes"].default)
    assert env["NGINX_MAX_REQUEST_BYTES"] == api_env["COMPILESVC_MAX_REQUEST_BYTES"] \
        == str(defaults["max_request_bytes"].default)
    assert depends_on(proxy)["api"]["condition"] == "service_healthy"
    test = proxy["healthcheck"]["test"]
    assert test[0] == "CMD" and any("127.0.0.1:8080/healthz" in part for part in test)
    assert proxy.get("restart") == "unless-stopped"


def test_proxy_template_sets_every_limit() -> None:
    """The directives docs/deploy.md promises are in the file compose mounts."""
    text = NGINX_TEMPLATE.read_text()
    for directive in ("client_header_timeout", "client_body_timeout", "send_timeout", "keepalive_timeout",
                      "large_client_header_buffers", "limit_conn ", "client_max_body_size",
                      "proxy_request_buffering on", "proxy_buffering off", "X-Forwarded-For $remote_addr",
                      "X-Forwarded-Proto $scheme"):
        assert directive in text, directive
        assert directive.split()[0] in DEPLOY_DOC.read_text(), f"docs/deploy.md does not explain {directive}"
    for status in (400, 408, 413, 414, 494, 502, 503, 504):
        assert re.search(rf"^\s*error_page {status} (=\d+ )?/_problem/", text, re.MULTILINE) or (
            status == 413 and "error_page 413 $compilesvc_413_page" in text), status
    pages = re.findall(r"return (\d{3}) '(\{.*\})';", text)
    assert len(pages) >= 10
    for status, body in pages:
        document = json.loads(re.sub(r"\$\{NGINX_MAX_[A-Z_]+\}", "1", body))
        assert document["status"] == int(status) and document["title"] and document["detail"], body
    assert text.count("default_type application/problem+json;") == len(pages)


def test_neuron_worker_is_behind_a_profile_with_a_neuron_device(services: dict[str, dict[str, Any]]) -> None:
    neuron = services["worker-neuron"]
    assert neuron.get("profiles") == ["neuron"]
    assert neuron["build"]["dockerfile"] == "docker/Dockerfile.neuron"
    host_devices = [d.split(":")[0] if isinstance(d, str) else d["source"] for d in neuron["devices"]]
    assert host_devices and all(re.fullmatch(r"/dev/neuron\d+", d) for d in host_devices), host_devices
    env = environment(neuron)
    assert "NEURON_COMPILE_CACHE_URL" not in env  # that cache does not apply to the trace API
    sdk = env["COMPILESVC_NEURON_SDK"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", sdk)
    assert neuron["build"]["args"]["NEURON_SDK"] == sdk
    assert f"-sdk{sdk}-" in neuron["build"]["args"]["NEURON_DLC_TAG"]
    assert neuron["image"].endswith(f":{sdk}")
    # No other service is profile-gated: `docker compose up` starts the whole cpu stack.
    assert [n for n, s in services.items() if s.get("profiles")] == ["worker-neuron"]


#: Credentials, which each service gets on its own (docs/security.md, "Compose: least privilege").
CREDENTIALS = {"COMPILESVC_DATABASE_URL", "PGPASSWORD", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
               "COMPILESVC_SECRET_KEY", "COMPILESVC_BOOTSTRAP_TOKEN", "COMPILESVC_SIGNING_KEY_FILE",
               "COMPILESVC_BROKER_URL"}
WORKERS = ("worker-cpu", "worker-neuron")
#: Settings only a worker reads (a worker-only environment, written once in x-worker-env).
WORKER_SETTINGS = {"COMPILESVC_DRAIN_SECONDS"}
RELAY_SETTINGS = {"COMPILESVC_RELAY_METRICS_PORT"}


def test_compilesvc_services_share_one_environment(raw: dict[str, Any], services: dict[str, dict[str, Any]]) -> None:
    base = environment({"environment": interpolate(raw["x-compilesvc-env"], {})})
    assert not set(base) & CREDENTIALS, "credentials belong to the services that need them"
    for name in COMPILESVC_SERVICES:
        env = environment(services[name])
        assert {k: v for k, v in env.items() if k in base} == base, name
        only_theirs = WORKER_SETTINGS if name in WORKERS else RELAY_SETTINGS if name == "relay" else set()
        assert set(env) - set(base) <= CREDENTIALS | {"COMPILESVC_NEURON_SDK"} | only_theirs, name
    assert set(environment(services["worker-neuron"])) - set(environment(services["worker-cpu"])) == \
        {"COMPILESVC_NEURON_SDK"}
    # Written once: every key of the shared environment is defined exactly once in the file.
    text = COMPOSE_FILE.read_text()
    for key in base:
        assert len(re.findall(rf"^\s+{key}:", text, re.MULTILINE)) == 1, key


def test_each_service_holds_only_its_own_credentials(raw: dict[str, Any], services: dict[str, dict[str, Any]]) -> None:
    secrets = interpolate(raw["x-secrets"], {})
    env = {name: environment(services[name]) for name in COMPILESVC_SERVICES}
    # The bootstrap token and the secret key: the API (and the relay's webhook signatures), never a worker.
    assert [n for n, e in env.items() if "COMPILESVC_BOOTSTRAP_TOKEN" in e] == ["api"]
    assert sorted(n for n, e in env.items() if "COMPILESVC_SECRET_KEY" in e) == ["api", "relay"]
    # The ledger: the owner migrates; the API and relay use the API's role, the workers their own.
    user = {n: e["COMPILESVC_DATABASE_URL"].split("//")[1].split("@")[0] for n, e in env.items()
            if "COMPILESVC_DATABASE_URL" in e}
    assert user == {"migrate": "compilesvc", "api": "compilesvc_api", "relay": "compilesvc_api",
                    "worker-cpu": "compilesvc_worker", "worker-neuron": "compilesvc_worker"}
    owner_password = secrets["postgres-password"]
    assert [n for n, e in env.items() if e.get("PGPASSWORD") == owner_password] == ["migrate"]
    for worker in WORKERS:
        assert env[worker]["PGPASSWORD"] == secrets["postgres-worker-password"]
        assert env[worker]["AWS_ACCESS_KEY_ID"] == secrets["s3-worker-access-key"]
        assert env[worker]["AWS_SECRET_ACCESS_KEY"] == secrets["s3-worker-secret-key"]
    # S3: the admin identity is s3-init's alone; each long-running service has its own.
    keys = {n: e.get("AWS_ACCESS_KEY_ID") for n, e in env.items()}
    assert [n for n, k in keys.items() if k == secrets["s3-access-key"]] == ["s3-init"]
    assert keys["api"] == secrets["s3-api-access-key"] and keys["relay"] == secrets["s3-relay-access-key"]
    assert len({keys["api"], keys["relay"], keys["worker-cpu"], keys["s3-init"]}) == 4
    # The S3 server and the ledger's init script get what they need to make those identities and roles.
    s3_env = environment(services["s3"])
    for name in ("API", "WORKER", "RELAY"):
        assert s3_env[f"S3_{name}_ACCESS_KEY"] == secrets[f"s3-{name.lower()}-access-key"]
    assert "./docker/seaweedfs:/compilesvc:ro" in services["s3"]["volumes"]
    pg_env = environment(services["postgres"])
    assert pg_env["POSTGRES_API_PASSWORD"] == secrets["postgres-api-password"]
    assert any(v.endswith(":/docker-entrypoint-initdb.d/10-compilesvc-roles.sh:ro")
               for v in services["postgres"]["volumes"])


#: The Redis user of each compilesvc service (docker/redis/users.sh); the one-shot jobs use no broker.
REDIS_USERS = {"api": "api", "relay": "relay", "worker-cpu": "worker", "worker-neuron": "worker"}


def test_each_service_has_its_own_redis_user(raw: dict[str, Any], services: dict[str, dict[str, Any]],
                                            tmp_path: Path) -> None:
    """Each long-running service reaches Redis as its own user, in its own broker URL; no service holds the
    admin password or logs in as ``default``, and the redis service makes exactly those users."""
    secrets = interpolate(raw["x-secrets"], {})
    admin_password = secrets["redis-password"]
    users: dict[str, str] = {}
    for name in COMPILESVC_SERVICES:
        env = environment(services[name])
        assert admin_password not in env.values(), name
        url = env.get("COMPILESVC_BROKER_URL")
        if url is None:
            continue
        parts = urlsplit(url)
        assert parts.scheme == "redis" and parts.hostname == "redis" and parts.path == "/0", url
        assert parts.username and parts.username != "default", f"{name} logs in as the default user"
        assert parts.password == secrets[f"redis-{parts.username}-password"] != admin_password, name
        users[name] = parts.username
    assert users == REDIS_USERS
    redis = services["redis"]
    assert redis["entrypoint"] == ["/bin/sh", "/compilesvc/start.sh"]
    assert "./docker/redis:/compilesvc:ro" in redis["volumes"]
    assert "--requirepass" not in redis["command"], "the users' ACL replaces the one password"
    redis_env = environment(redis)
    for user in ("", *sorted(set(REDIS_USERS.values()))):
        variable, secret = (f"REDIS_{user.upper()}_PASSWORD", f"redis-{user}-password") if user else \
            ("REDIS_PASSWORD", "redis-password")
        assert redis_env[variable] == secrets[secret], variable
    healthcheck = " ".join(redis["healthcheck"]["test"])
    assert "--user healthcheck" in healthcheck and "grep -q PONG" in healthcheck
    # The users the ACL script makes from compose's own values: every URL's user is one of them.
    acl = tmp_path / "users.acl"
    done = subprocess.run(["sh", str(ROOT / "docker" / "redis" / "users.sh"), str(acl)], capture_output=True,
                          text=True, timeout=30, env={"PATH": os.environ["PATH"], **redis_env,
                                                      "ALLOW_PLACEHOLDER_SECRETS": "true",
                                                      "REDIS_HEALTHCHECK_PASSWORD": "generated-at-start"})
    assert done.returncode == 0, done.stderr
    made = {line.split()[1]: line.split()[2] for line in acl.read_text().splitlines()}
    assert made == {"default": "off", "admin": "on", "healthcheck": "on", **{u: "on" for u in REDIS_USERS.values()}}


def test_the_store_is_published_on_one_internal_address_only(services: dict[str, dict[str, Any]]) -> None:
    ports = services["s3"]["ports"]
    assert ports == ["127.0.0.1:8333:8333"], "never on all interfaces: S3_PUBLISH_ADDRESS picks one"
    for name, service in services.items():
        for port in _published(service):
            assert port.count(":") == 2 or name == "proxy", f"{name} publishes {port} on every interface"


def test_environment_names_are_real(services: dict[str, dict[str, Any]]) -> None:
    fields = {f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields}
    used = {key for service in services.values() for key in environment(service) if key.startswith(ENV_PREFIX)}
    unknown = used - fields - PROCESS_ENV
    assert not unknown, f"not Settings fields (compilesvc/config/settings.py) nor read elsewhere: {sorted(unknown)}"
    sources = "\n".join(p.read_text() for d in ("compilesvc", "web", "workers") for p in (ROOT / d).rglob("*.py"))
    for name in sorted((used | PROCESS_ENV) - fields):
        assert name in sources, f"{name} is in PROCESS_ENV but no code reads it any more"


def test_default_environment_is_valid_settings_and_refused_as_placeholders(
        services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic import ValidationError

    for name in LONG_RUNNING:
        for key in list(os.environ):
            if key.startswith(ENV_PREFIX) or key in ("PGPASSWORD", "AWS_SECRET_ACCESS_KEY"):
                monkeypatch.delenv(key)
        for key, value in environment(services[name]).items():
            monkeypatch.setenv(key, value)
        # The defaults are placeholders: every process refuses them ...
        with pytest.raises(ValidationError, match="placeholder"):
            Settings()
        # ... unless the stack says it is a development one.
        monkeypatch.setenv("COMPILESVC_ALLOW_PLACEHOLDER_SECRETS", "true")
        settings = Settings()
        assert settings.database_url and settings.database_url.startswith("postgresql+psycopg://")
        assert settings.broker_url and settings.broker_url.startswith("redis://")
        assert settings.store_url and settings.store_url.startswith("s3://")
        assert settings.s3_endpoint_url  # an empty endpoint would reach boto3 as "" and fail


def test_every_variable_is_in_env_example(raw: dict[str, Any]) -> None:
    documented = {line.split("=", 1)[0] for line in ENV_EXAMPLE.read_text().splitlines()
                  if line and not line.startswith("#") and "=" in line}
    missing = variables_used(COMPOSE_FILE.read_text()) - documented
    assert not missing, f"add to docker/env.example: {sorted(missing)}"


def test_secrets_are_placeholders(raw: dict[str, Any]) -> None:
    """Every secret defaults to an obvious placeholder, never something that looks real."""
    secrets = interpolate(raw["x-secrets"], {})
    for name, value in secrets.items():
        if "password" in name or "secret" in name:
            assert value.startswith("change-me"), name
    for name in ("x-broker-api", "x-broker-relay", "x-broker-worker"):
        assert (urlsplit(interpolate(raw[name], {})).password or "").startswith("change-me"), name
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.partition("=")
        if any(word in key for word in ("PASSWORD", "SECRET")) and key != "COMPILESVC_ALLOW_PLACEHOLDER_SECRETS":
            assert value.startswith("change-me"), key


# -- the images ------------------------------------------------------------------------------------------

def _arg_default(dockerfile: Path, name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", dockerfile.read_text(), re.MULTILINE)
    assert match, f"{dockerfile.name} has no ARG {name}=…"
    return match.group(1)


def test_cpu_image_installs_the_pinned_torch_from_the_cpu_index() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = [r for r in extras["cpu"] if re.match(r"torch\s*==", r)]
    assert pins, "the cpu extra no longer pins torch"
    assert _arg_default(DOCKERFILE, "TORCH_VERSION") == pins[0].split("==")[1].strip()
    assert _arg_default(DOCKERFILE, "TORCH_INDEX_URL") == "https://download.pytorch.org/whl/cpu"
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM \$\{PYTHON_IMAGE\}\s*$", text, re.MULTILINE)
    assert _arg_default(DOCKERFILE, "PYTHON_IMAGE") == "python:3.11-slim"
    assert re.search(r"^USER compilesvc$", text, re.MULTILINE)
    assert 'ENTRYPOINT ["tini", "-s", "--", "compilesvc"]' in text  # PID 1 reaps, also on Kubernetes
    assert "-r /tmp/build/server.lock" in text  # the image runs the service, not only the client (test_lock.py)


def test_neuron_image_defaults_agree_with_compose(services: dict[str, dict[str, Any]]) -> None:
    args = services["worker-neuron"]["build"]["args"]
    assert _arg_default(DOCKERFILE_NEURON, "NEURON_SDK") == args["NEURON_SDK"]
    assert _arg_default(DOCKERFILE_NEURON, "NEURON_DLC_TAG") == args["NEURON_DLC_TAG"]
    assert _arg_default(DOCKERFILE_NEURON, "NEURON_DLC_IMAGE").startswith("public.ecr.aws/neuron/")
    text = DOCKERFILE_NEURON.read_text()
    assert "pip.repos.neuron.amazonaws.com" in text
    assert '"/src[server,neuron]"' in text and "cpu]" not in text  # the worker's packages, not the cpu torch pin
    # The DLC's Python must be able to install compilesvc (requires-python).
    assert re.search(r"-py3(1[1-9])-", args["NEURON_DLC_TAG"]), "compilesvc needs Python >= 3.11"


# -- documentation ---------------------------------------------------------------------------------------

def test_deploy_doc_lists_every_setting() -> None:
    text = DEPLOY_DOC.read_text()
    missing = [f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields
               if f"`{ENV_PREFIX}{name.upper()}`" not in text]
    assert not missing, f"docs/deploy.md's settings table lacks {missing}"


def test_the_publishing_services_and_only_they_get_the_signing_key(raw: dict[str, Any],
                                                                   services: dict[str, dict[str, Any]]) -> None:
    """The artifact signing key is a file secret of the api, relay and workers (they publish), named by
    COMPILESVC_SIGNING_KEY_FILE where the secret is mounted; nothing else gets it, nothing has it in its
    environment."""
    publishers = {"api", "relay", *WORKERS}
    assert raw["secrets"]["signing_key"]["file"]
    holders = {name for name, service in services.items() if "signing_key" in (service.get("secrets") or [])}
    assert holders == publishers
    for name in publishers:
        assert environment(services[name])["COMPILESVC_SIGNING_KEY_FILE"] == "/run/secrets/signing_key", name
    for name, service in services.items():
        assert not [v for v in environment(service).values() if "PRIVATE KEY" in str(v)], name


def test_the_relay_serves_its_metrics_on_the_compose_network_only(services: dict[str, dict[str, Any]]) -> None:
    relay = services["relay"]
    port = environment(relay)["COMPILESVC_RELAY_METRICS_PORT"]
    assert relay["expose"] == [port] and "ports" not in relay  # `--scale relay=2` must not fight over a host port
    assert not any("COMPILESVC_RELAY_METRICS_PORT" in environment(services[n]) for n in COMPILESVC_SERVICES
                   if n != "relay")


def test_workers_report_consuming_and_are_restarted(services: dict[str, dict[str, Any]]) -> None:
    """Healthy = consuming (the worker's liveness file, workers/liveness.py); a worker that stops consuming
    exits 75, and `restart: unless-stopped` starts a fresh one (compose does not restart an unhealthy one)."""
    for name in ("worker-cpu", "worker-neuron"):
        assert services[name]["healthcheck"]["test"] == ["CMD", "python", "-m", "compilesvc.liveness", "worker"]
        assert services[name]["restart"] == "unless-stopped"
