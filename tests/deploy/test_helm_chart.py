"""deploy/helm/compilesvc: the chart rendered offline (helm-python-sdk, no helm binary, no cluster) and checked.

Three values files (deploy/helm/examples: minimal, EKS with Neuron pools and KEDA, ScaledJob mode): lint, every
object against the Kubernetes schema (kubernetes-validate --strict) or its CRD's (KEDA, Karpenter, Prometheus
operator; vendored in tests/deploy/crd_schemas), checkov, and consistency with the code: queue names equal
compilesvc.dispatch.routing.queue_name(), every setting the chart sets is a Settings field, the environment of
each component is docker-compose.yml's, grace periods cover the drain window, and the KEDA query counts a real
ledger right. Each kind of check also has a broken value that it, and no earlier one, refuses.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import kubernetes_validate
import pytest
import yaml
from sqlalchemy import create_engine, text

from compilesvc.config.settings import Settings
from compilesvc.dispatch.routing import queue_name
from compilesvc.spec.neuron_kinds import kind_request, release_kinds
from compilesvc.states import BucketState
from tests.fixtures.docs import doc_block
from workers.host import pod_protection

helm = pytest.importorskip("helm_python", reason="helm-python-sdk has no wheel for this platform (pyproject.toml)")

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "compilesvc"
EXAMPLES = {p.stem: p for p in sorted((ROOT / "deploy" / "helm" / "examples").glob("*.yaml"))}
CRDS = Path(__file__).with_name("crd_schemas")
KARPENTER = ROOT / "deploy" / "kubernetes" / "karpenter-nodepools.yaml"
CHECKOV = ROOT / ".ci" / "checkov" / "venv" / "bin" / "checkov"
KUBERNETES_VERSION = "1.33.0"  # the chart's kubeVersion floor is 1.30; user-namespaced bwrap pods need 1.33


def values_of(example: str) -> dict[str, Any]:
    return dict(yaml.safe_load(EXAMPLES[example].read_text()))


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    chart = helm.Chart.load(CHART)
    out = chart.render(values, name="compilesvc", namespace="compilesvc", is_install=True)
    return [doc for manifest in out.values() for doc in yaml.safe_load_all(manifest) if doc]


@functools.cache
def rendered(example: str) -> tuple[dict[str, Any], ...]:
    return tuple(render(values_of(example)))


def merged_values(example: str) -> dict[str, Any]:
    return helm.Chart.load(CHART).merge_values(values_of(example))


def pools(example: str) -> list[dict[str, Any]]:
    values = merged_values(example)
    found = []
    for pool in values["workers"]["pools"]:
        merged = copy.deepcopy(values["workers"]["defaults"])
        merged.update(pool)
        found.append(merged)
    return found


def pod_specs(docs: tuple[dict[str, Any], ...] | list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    specs = {}
    for doc in docs:
        kind, spec = doc["kind"], doc.get("spec", {})
        if kind in ("Deployment", "Job"):
            specs[doc["metadata"]["name"]] = spec["template"]["spec"]
        elif kind == "CronJob":
            specs[doc["metadata"]["name"]] = spec["jobTemplate"]["spec"]["template"]["spec"]
        elif kind == "ScaledJob":
            specs[doc["metadata"]["name"]] = spec["jobTargetRef"]["template"]["spec"]
    return specs


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """A pod's containers, its native sidecars (the pod split's compile container) first."""
    return [*spec.get("initContainers", []), *spec["containers"]]


def env_names(container: dict[str, Any], docs: tuple[dict[str, Any], ...]) -> set[str]:
    names = {e["name"] for e in container.get("env", [])}
    for source in container.get("envFrom", []):
        ref = source["configMapRef"]["name"]
        names |= set(next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == ref)["data"])
    return names


# -- render, lint, schemas -----------------------------------------------------------------------------------

@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_the_chart_lints_clean(example: str) -> None:
    report = helm.lint(CHART, values_of(example), strict=True, kube_version=f"v{KUBERNETES_VERSION}")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def _strict(schema: Any) -> Any:
    """A CRD schema as the API server applies it to our objects: unknown fields refused (the server would
    prune them silently, which hides a misspelt field), except where the CRD keeps unknown fields."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if schema.get("type") == "object" and "properties" in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema.setdefault("additionalProperties", False)
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.cache
def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    found = {}
    for path in CRDS.glob("*.json"):
        crd = json.loads(path.read_text())
        found[(f"{crd['group']}/{crd['version']}", crd["kind"])] = _strict(crd["schema"])
    return found


def validate(doc: dict[str, Any]) -> None:
    schema = crd_schemas().get((doc["apiVersion"], doc["kind"]))
    if schema is not None:
        jsonschema.validate(doc, schema)
    else:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_every_object_validates_against_its_schema(example: str) -> None:
    docs = rendered(example)
    for doc in docs:
        validate(doc)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "ConfigMap", "Job", "ServiceAccount", "NetworkPolicy", "PodDisruptionBudget"} <= kinds
    if example == "eks-neuron-keda":
        assert {"ScaledObject", "TriggerAuthentication", "ServiceMonitor"} <= kinds
    if example == "scaledjob":
        assert "ScaledJob" in kinds


def test_the_karpenter_examples_validate_and_outlast_every_worker_grace() -> None:
    docs = [d for d in yaml.safe_load_all(KARPENTER.read_text()) if d]
    for doc in docs:
        validate(doc)
    nodepools = {d["metadata"]["name"]: d for d in docs if d["kind"] == "NodePool"}
    assert set(nodepools) == {"compilesvc-compile", "compilesvc-neuron"}
    device = nodepools["compilesvc-neuron"]["spec"]["template"]["spec"]
    assert {"key": "aws.amazon.com/neuron", "effect": "NoSchedule"} in device["taints"]
    assert "taints" not in nodepools["compilesvc-compile"]["spec"]["template"]["spec"]

    def seconds(duration: str) -> int:
        units = {"h": 3600, "m": 60, "s": 1}
        total, number = 0, ""
        for char in duration:
            if char.isdigit():
                number += char
            else:
                total, number = total + int(number) * units[char], ""
        return total

    longest = max(int(spec["terminationGracePeriodSeconds"]) for example in EXAMPLES
                  for name, spec in pod_specs(rendered(example)).items() if "-worker-" in name)
    for pool in nodepools.values():  # Karpenter deletes a pod once its NodePool's grace has run out
        assert seconds(pool["spec"]["template"]["spec"]["terminationGracePeriod"]) >= longest


# -- checkov ---------------------------------------------------------------------------------------------------

#: Checks the chart fails on purpose, and why.
CHECKOV_ACCEPTED = {
    "CKV_K8S_21": "namespace comes from `helm install -n`, not the templates",
    "CKV_K8S_43": "images are pinned by digest through image.digest; the examples use tags",
    "CKV_K8S_15": "IfNotPresent with digest-pinned images is the same image",
    "CKV_K8S_35": "PGPASSWORD and the broker URL are read from the environment (libpq, Settings)",
    "CKV_K8S_40": "nginx-unprivileged's fixed uid is 101",
    "CKV_K8S_8": "relay and workers: their liveness is their ledger heartbeat (the reaper acts on it); the relay's "
                 "metrics port is no liveness signal",
    "CKV_K8S_9": "as CKV_K8S_8",
}


def checkov_failures(docs_by_name: dict[str, list[dict[str, Any]]], tmp_path: Path) -> dict[str, set[str]]:
    if not CHECKOV.exists():
        pytest.skip("checkov is not installed: `make test-tools` installs it into .ci/checkov (its pins conflict "
                    "with the project's boto3)")
    for name, docs in docs_by_name.items():
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump_all(docs))
    result = subprocess.run(
        [str(CHECKOV), "-d", str(tmp_path), "--framework", "kubernetes", "--quiet", "--compact", "-o", "json",
         "--skip-download"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "BC_API_KEY": "", "LOG_LEVEL": "ERROR"})
    reports = json.loads(result.stdout)
    failures: dict[str, set[str]] = {}
    for report in reports if isinstance(reports, list) else [reports]:
        for check in report["results"]["failed_checks"]:
            failures.setdefault(check["check_id"], set()).add(check["resource"])
    return failures


@pytest.mark.slow  # a checkov process (several seconds)
def test_checkov_finds_nothing_but_the_accepted_checks(tmp_path: Path) -> None:
    failures = checkov_failures({name: list(rendered(name)) for name in EXAMPLES}, tmp_path)
    assert set(failures) <= set(CHECKOV_ACCEPTED), {k: v for k, v in failures.items() if k not in CHECKOV_ACCEPTED}


@pytest.mark.slow  # a checkov process (several seconds)
def test_checkov_refuses_a_container_without_a_memory_limit(tmp_path: Path) -> None:
    values = values_of("minimal")
    values["api"] = {"resources": {"limits": {"memory": None}}}  # null deletes the default
    docs = render(values)  # the schema and the Kubernetes schema allow it
    for doc in docs:
        validate(doc)
    failures = checkov_failures({"no-memory-limit": docs}, tmp_path)
    assert failures.get("CKV_K8S_13") == {"Deployment.default.compilesvc-api"}


def test_a_bwrap_pool_gets_what_compose_gives_bubblewrap_and_nothing_else_does() -> None:
    values = values_of("minimal")
    values["workers"] = {"pools": [{"name": "cpu", "target": "cpu", "release": "2.13.0",
                                    "queues": ["compile.cpu.2.13.0"], "sandbox": "bwrap"}]}
    docs = render(values)
    for doc in docs:
        validate(doc)
    specs = pod_specs(docs)
    spec = specs["compilesvc-worker-cpu"]
    assert spec["hostUsers"] is False and [c["name"] for c in spec["containers"]] == ["worker"]
    context = spec["containers"][0]["securityContext"]
    # compose's security_opt: seccomp=unconfined, apparmor=unconfined, systempaths=unconfined.
    assert context["seccompProfile"] == {"type": "Unconfined"} and context["appArmorProfile"] == {"type": "Unconfined"}
    assert context["procMount"] == "Unmasked" and context["capabilities"]["drop"] == ["ALL"]
    env = {e["name"] for e in spec["containers"][0]["env"]}
    assert "COMPILESVC_SANDBOX" not in env  # bwrap is the default
    for name, other in specs.items():
        if name != "compilesvc-worker-cpu":
            assert all(c["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault" for c in containers(other))


# -- consistency with the code --------------------------------------------------------------------------------

def expected_queues(pool: dict[str, Any]) -> list[str]:
    if pool["target"] == "cpu":
        return [queue_name("cpu", pool["release"], "torchscript")] + [
            queue_name("cpu", pool["release"], "aotinductor", isa) for isa in pool.get("isas", [])]
    kinds = pool.get("kinds") or release_kinds(pool["release"])
    return [queue_name(pool["target"], pool["release"], *_backend_tp(kind)) for kind in kinds]


def _backend_tp(kind: str) -> tuple[str, None, int]:
    backend, tp = kind_request(kind)
    return backend, None, tp


def queue_mismatches(example_pools: list[dict[str, Any]]) -> list[str]:
    return [f"{p['name']}: {p['queues']} != {expected_queues(p)}" for p in example_pools
            if sorted(p["queues"]) != sorted(expected_queues(p))]


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_pool_queues_are_what_dispatch_routes_to_and_what_the_worker_consumes(example: str) -> None:
    assert queue_mismatches(pools(example)) == []
    specs = pod_specs(rendered(example))
    for pool in pools(example):
        spec = specs[f"compilesvc-worker-{pool['name']}"]
        worker = next(c for c in spec["containers"] if c["name"] == "worker")
        assert worker["args"][worker["args"].index("--queues") + 1].split(",") == pool["queues"]
        env = {e["name"]: e.get("value") for e in worker["env"]}
        assert env.get("COMPILESVC_NEURON_SDK") == (None if pool["target"] == "cpu" else pool["release"])


def test_a_queue_named_by_its_release_instead_of_its_toolchain_is_refused() -> None:
    pool = dict(pools("eks-neuron-keda")[1], queues=["compile.inf2.2.27.1.trace"], kinds=["trace"])
    render({**values_of("eks-neuron-keda"), "workers": {"pools": [pool]}})  # the schema cannot know
    assert queue_mismatches([pool]) == ["inf2-2-27: ['compile.inf2.2.27.1.trace'] != ['compile.inf2.2.27.0.trace']"]


#: COMPILESVC_ variables the code reads outside Settings, and where.
READ_ELSEWHERE = {"COMPILESVC_LOG_LEVEL": "compilesvc/jsonlog.py", "COMPILESVC_NEURON_SDK": "workers/host/versions.py"}


def known_settings() -> set[str]:
    for name, module in READ_ELSEWHERE.items():
        assert f'"{name}"' in (ROOT / module).read_text(), (name, module)
    return {f"COMPILESVC_{name.upper()}" for name in Settings.model_fields} | set(READ_ELSEWHERE)


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_every_setting_the_chart_sets_is_a_settings_field(example: str) -> None:
    fields = known_settings()
    docs = rendered(example)
    set_names = {name for spec in pod_specs(docs).values() for c in spec["containers"]
                 for name in env_names(c, docs) if name.startswith("COMPILESVC_")}
    assert set_names and set_names <= fields, set_names - fields


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_the_settings_the_chart_gives_a_worker_load(example: str, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = rendered(example)
    spec = next(s for n, s in pod_specs(docs).items() if "-worker-" in n)
    worker = next(c for c in spec["containers"] if c["name"] == "worker")
    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "compilesvc-config")
    for name in [n for n in os.environ if n.startswith("COMPILESVC_")]:
        monkeypatch.delenv(name)
    for name, value in {**config["data"], **{e["name"]: e["value"] for e in worker["env"] if "value" in e}}.items():
        monkeypatch.setenv(name, value)
    settings = Settings()
    assert settings.compile_timeout_seconds == merged_values(example)["compileTimeoutSeconds"]
    assert settings.store_url == merged_values(example)["config"]["storeUrl"]
    assert settings.model_s3_prefixes == merged_values(example)["config"]["modelS3Prefixes"]
    assert settings.database_url and settings.database_url.startswith("postgresql+psycopg://compilesvc_worker@")
    assert settings.task_hard_limit_seconds > settings.compile_timeout_seconds


def test_a_misspelt_extra_setting_is_refused() -> None:
    values = values_of("minimal")
    values["config"]["extra"] = {"COMPILESVC_OPEN_READ": "true"}
    docs = render(values)  # the schema accepts any COMPILESVC_ name
    fields = known_settings()
    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "compilesvc-config")
    assert set(config["data"]) - fields == {"COMPILESVC_OPEN_READ"}


#: Variables a component has in the chart but not in docker-compose.yml (or the reverse), and why.
CHART_ONLY = {"POD_NAME",  # the worker's name in the registry
              "COMPILESVC_COMPILE_TIMEOUT_SECONDS",  # set explicitly: the grace periods follow it
              "COMPILESVC_SANDBOX", "COMPILESVC_COMPILE_SPOOL",  # the pod split
              "COMPILESVC_KUBERNETES_PROTECT", "POD_NAMESPACE",  # a compiling worker annotates its pod
              "COMPILESVC_SCALABLE_QUEUES",  # the KEDA pools' queues: compose has no pool that scales from zero
              "COMPILESVC_SANDBOX_MAX_DISK_MB"}  # below the work directory's emptyDir (compilesvc.sandboxDisk)
COMPOSE_ONLY: set[str] = set()
PAIRS = {"compilesvc-api": ("api", "api"), "compilesvc-relay": ("relay", "relay"),
         "compilesvc-worker-cpu": ("worker", "worker-cpu"), "compilesvc-migrate": ("migrate", "migrate")}


def compose_environment(service: str) -> set[str]:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return set(compose["services"][service]["environment"])


def test_each_component_gets_the_environment_compose_gives_it() -> None:
    docs = rendered("minimal")  # static S3 keys and an S3 endpoint, as compose
    specs = pod_specs(docs)
    for name, (container, service) in PAIRS.items():
        chart = env_names(next(c for c in specs[name]["containers"] if c["name"] == container), docs)
        compose = compose_environment(service)
        if name == "compilesvc-migrate":  # a hook: only what migrations read
            assert chart - CHART_ONLY <= compose and {"COMPILESVC_DATABASE_URL", "PGPASSWORD"} <= chart
            continue
        assert chart - CHART_ONLY == compose - COMPOSE_ONLY, (name, chart ^ compose)
    neuron = pod_specs(rendered("eks-neuron-keda"))["compilesvc-worker-inf2-2-27"]
    chart = env_names(next(c for c in neuron["containers"] if c["name"] == "worker"), rendered("eks-neuron-keda"))
    aws = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "COMPILESVC_S3_ENDPOINT_URL"}
    assert chart - CHART_ONLY == compose_environment("worker-neuron") - aws


@pytest.mark.parametrize("example", ["eks-neuron-keda", "scaledjob"])
def test_with_service_account_credentials_no_aws_key_is_rendered(example: str) -> None:
    text_ = yaml.safe_dump_all(list(rendered(example)))
    assert "AWS_ACCESS_KEY_ID" not in text_ and "AWS_SECRET_ACCESS_KEY" not in text_
    accounts = {d["metadata"]["name"]: d for d in rendered(example) if d["kind"] == "ServiceAccount"}
    assert all(a["automountServiceAccountToken"] is False for a in accounts.values())
    if example == "eks-neuron-keda":
        assert accounts["compilesvc-worker"]["metadata"]["annotations"]["eks.amazonaws.com/role-arn"]


def test_no_object_is_a_secret_and_every_secret_reference_names_values_secrets() -> None:
    for example in EXAMPLES:
        values = merged_values(example)
        names = {s["existingSecret"] for s in values["secrets"].values()}
        for doc in rendered(example):
            assert doc["kind"] != "Secret"
        for spec in pod_specs(rendered(example)).values():
            refs = {e["valueFrom"]["secretKeyRef"]["name"] for c in spec["containers"] for e in c.get("env", [])
                    if "secretKeyRef" in e.get("valueFrom", {})}
            refs |= {v["secret"]["secretName"] for v in spec.get("volumes", []) if "secret" in v}
            assert refs <= names


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_pods_are_non_root_read_only_and_unprivileged_with_bounded_scratch(example: str) -> None:
    for name, spec in pod_specs(rendered(example)).items():
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        assert spec["automountServiceAccountToken"] is False, name
        for container in containers(spec):
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] and context["allowPrivilegeEscalation"] is False, name
            assert context["capabilities"]["drop"] == ["ALL"], name
            assert {"cpu", "memory", "ephemeral-storage"} <= set(container["resources"]["limits"]), name
        for volume in spec["volumes"]:
            if "emptyDir" in volume:
                assert volume["emptyDir"]["sizeLimit"], (name, volume["name"])


def test_devices_only_for_pools_that_need_one_and_hooks_and_gc_as_the_issue_says() -> None:
    docs = rendered("eks-neuron-keda")
    specs = pod_specs(docs)
    for pool in pools("eks-neuron-keda"):
        spec = specs[f"compilesvc-worker-{pool['name']}"]
        devices = [c["resources"]["limits"].get("aws.amazon.com/neuron") for c in containers(spec)]
        tolerations = [t["key"] for t in spec.get("tolerations", [])]
        if pool["neuronDevices"]:
            assert pool["neuronDevices"] in devices and "aws.amazon.com/neuron" in tolerations
        else:
            assert devices == [None] * len(devices) and "aws.amazon.com/neuron" not in tolerations
    job = next(d for d in docs if d["kind"] == "Job")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    cron = next(d for d in docs if d["kind"] == "CronJob")
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    for doc in docs:
        if doc["kind"] == "Deployment" and doc["metadata"]["name"] != "compilesvc-proxy":
            assert doc["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    api = specs["compilesvc-api"]["containers"][0]
    assert api["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert api["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_network_policies_let_the_proxy_reach_the_api_and_nothing_reach_a_worker() -> None:
    docs = rendered("eks-neuron-keda")
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    api = {"app.kubernetes.io/name": "compilesvc", "app.kubernetes.io/instance": "compilesvc",
           "app.kubernetes.io/component": "api"}
    egress = policies["compilesvc-egress"]["egress"]
    assert {"to": [{"podSelector": {"matchLabels": api}}], "ports": [{"protocol": "TCP", "port": 8080}]} in egress
    assert all(rule.get("to") for rule in egress)
    assert policies["compilesvc-api"]["podSelector"]["matchLabels"] == api
    deny = policies["compilesvc-deny-ingress"]
    assert deny["ingress"] == [] and {"key": "app.kubernetes.io/component", "operator": "NotIn",
                                      "values": ["api", "proxy"]} in deny["podSelector"]["matchExpressions"]


def test_the_proxy_template_is_docker_nginx_s() -> None:
    assert (CHART / "files" / "nginx.conf.template").read_bytes() == \
        (ROOT / "docker" / "nginx" / "compilesvc.conf.template").read_bytes()


# -- grace periods and scaling ----------------------------------------------------------------------------------

@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_worker_grace_covers_the_drain_window(example: str) -> None:
    """The worker drains for exactly the window the chart's grace period is computed from."""
    values = merged_values(example)
    assert values["drainWindowSeconds"] <= values["compileTimeoutSeconds"]
    windows = {p["name"]: p.get("drainWindowSeconds", values["drainWindowSeconds"]) for p in pools(example)}
    seen = 0
    for name, spec in pod_specs(rendered(example)).items():
        pool = next((p for p in windows if name.endswith(f"-worker-{p}")), None)
        if pool is None:
            continue
        seen += 1
        worker = next(c for c in spec["containers"] if c["name"] == "worker")
        drain = next(e["value"] for e in worker["env"] if e["name"] == "COMPILESVC_DRAIN_SECONDS")
        assert float(drain) == windows[pool], name
        assert spec["terminationGracePeriodSeconds"] >= windows[pool] + values["graceMarginSeconds"]
    assert seen == len(windows)


def test_a_pool_may_drain_for_less_than_the_chart() -> None:
    """A spot pool fits its drain in EC2's two-minute notice: its own window, its own grace."""
    values = values_of("minimal")
    values["workers"] = {"pools": [{"name": "spot", "target": "cpu", "release": "2.13.0",
                                    "queues": ["compile.cpu.2.13.0"], "drainWindowSeconds": 90}]}
    spec = pod_specs(tuple(render(values)))["compilesvc-worker-spot"]
    worker = next(c for c in spec["containers"] if c["name"] == "worker")
    assert {"name": "COMPILESVC_DRAIN_SECONDS", "value": "90"} in worker["env"]
    assert spec["terminationGracePeriodSeconds"] == 90 + merged_values("minimal")["graceMarginSeconds"]


def test_a_grace_shorter_than_the_drain_window_is_refused_at_render() -> None:
    values = values_of("minimal")
    values["drainWindowSeconds"] = 3600
    values["workers"] = {"pools": [{"name": "cpu", "target": "cpu", "release": "2.13.0",
                                    "queues": ["compile.cpu.2.13.0"], "terminationGracePeriodSeconds": 600}]}
    with pytest.raises(helm.HelmRenderError, match="shorter than drainWindowSeconds"):
        render(values)


def test_more_than_one_compile_per_pod_split_pod_is_refused_at_render() -> None:
    values = values_of("minimal")
    values["workers"] = {"pools": [{"name": "cpu", "target": "cpu", "release": "2.13.0",
                                    "queues": ["compile.cpu.2.13.0"], "concurrency": 2}]}
    with pytest.raises(helm.HelmRenderError, match="one compile at a time"):
        render(values)
    values["workers"]["pools"][0]["sandbox"] = "bwrap"  # bubblewrap sandboxes each compile on its own
    worker = pod_specs(render(values))["compilesvc-worker-cpu"]["containers"][0]
    assert worker["args"][:3] == ["worker", "--concurrency", "2"]


def test_schema_and_kubernetes_validate_each_refuse_their_broken_value() -> None:
    with pytest.raises(helm.HelmValuesError, match="queues"):  # also keeps quotes out of the scaler's SQL
        render({**values_of("minimal"), "workers": {"pools": [
            {"name": "cpu", "target": "cpu", "release": "2.13.0", "queues": ["compile.cpu.2.13.0') OR ('1"]}]}})
    values = values_of("minimal")
    values["workers"] = {"pools": [{"name": "cpu", "target": "cpu", "release": "2.13.0",
                                    "queues": ["compile.cpu.2.13.0"],
                                    "tolerations": [{"key": "x", "operator": "Exists", "efect": "NoSchedule"}]}]}
    deployment = next(d for d in render(values) if d["metadata"]["name"] == "compilesvc-worker-cpu")
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)


def test_a_misspelt_keda_field_fails_its_crd_schema() -> None:
    scaled = copy.deepcopy(next(d for d in rendered("scaledjob") if d["kind"] == "ScaledJob"))
    scaled["spec"]["rollout"] = {"strategy": "graduall"}
    with pytest.raises(jsonschema.ValidationError):
        validate(scaled)


def scaler_queries(example: str) -> dict[str, tuple[str, str]]:
    found = {}
    for doc in rendered(example):
        if doc["kind"] in ("ScaledObject", "ScaledJob"):
            trigger = doc["spec"]["triggers"][0]
            assert trigger["type"] == "postgresql" and trigger["metadata"]["activationTargetQueryValue"] == "0"
            found[doc["metadata"]["name"]] = (trigger["metadata"]["query"], trigger["metadata"]["targetQueryValue"])
    return found


def test_scaled_job_mode_rolls_out_gradually_one_compile_per_job() -> None:
    scaled = next(d for d in rendered("scaledjob") if d["kind"] == "ScaledJob")
    assert scaled["spec"]["rollout"]["strategy"] == "gradual"
    assert scaled["spec"]["scalingStrategy"]["strategy"] == "default"  # the query counts running compiles too
    assert scaled["spec"]["jobTargetRef"]["template"]["spec"]["restartPolicy"] == "Never"
    worker = next(c for c in scaled["spec"]["jobTargetRef"]["template"]["spec"]["containers"] if c["name"] == "worker")
    assert worker["args"][-2:] == ["--max-compiles", "1"]  # the Job's worker exits after its compile
    assert scaler_queries("scaledjob")["compilesvc-worker-trn1-2-27"][1] == "1"


def test_the_scaler_query_counts_queued_and_running_compiles_of_the_pool_on_a_real_ledger(pg_url: str) -> None:
    queries = scaler_queries("eks-neuron-keda")
    assert set(queries) == {f"compilesvc-worker-{p['name']}" for p in pools("eks-neuron-keda")}
    all_queues = sorted({q for p in pools("eks-neuron-keda") for q in p["queues"]} | {"compile.trn1.2.27.0.trace"})
    engine = create_engine(pg_url)
    expected: dict[str, int] = {}
    with engine.begin() as conn:
        n = 0
        for queue in all_queues:
            for state in BucketState:
                for _ in range(2 if state == BucketState.RUNNING else 1):
                    n += 1
                    conn.execute(text(
                        "INSERT INTO bucket_compiles (key, state, target, sdk, backend, queue, model, material, "
                        "inputs, attempts, max_attempts, attempt_round, lease_token, cancel_requested, queued_at, "
                        "updated_at) VALUES (:key, :state, 'inf2', '2.27.1', 'trace', :queue, '{}', '{}', '[]', "
                        "0, 3, 0, 0, false, now(), now())"), {"key": f"k{n}", "state": state.value, "queue": queue})
        for pool in pools("eks-neuron-keda"):
            expected[f"compilesvc-worker-{pool['name']}"] = 3 * len(pool["queues"])  # 1 queued + 2 running each
        for name, (query, target) in queries.items():
            assert conn.execute(text(query)).scalar_one() == expected[name], name
            assert target == str(next(p for p in pools("eks-neuron-keda")
                                      if name.endswith(p["name"]))["concurrency"])
        conn.execute(text("SET LOCAL enable_seqscan = off"))  # tiny table: ask which index the plan can use
        plan = "\n".join(conn.scalars(text("EXPLAIN " + queries["compilesvc-worker-cpu"][0])))
        assert "ix_bucket_compiles_active_queue" in plan and "Seq Scan" not in plan, plan
        # docs/kubernetes.md's role for KEDA may run it, and read nothing else (the role is the server's, so a
        # name of this test's own, gone with the transaction).
        role = f"compilesvc_scaler_{os.getpid()}"
        grant = doc_block("kubernetes.md", "The scaler's role may read", "sql").replace("compilesvc_scaler", role)
        for statement in filter(str.strip, grant.split(";")):
            conn.execute(text(statement))
        conn.execute(text(f"SET LOCAL ROLE {role}"))
        assert conn.execute(text(queries["compilesvc-worker-inf2-device"][0])).scalar_one() == 3
        with pytest.raises(Exception, match="permission denied"):
            conn.execute(text("SELECT count(*) FROM builds"))


def test_the_query_docs_kubernetes_md_shows_is_the_chart_s() -> None:
    shown = doc_block("kubernetes.md", "The query the chart renders", "sql").strip()
    assert shown == scaler_queries("eks-neuron-keda")["compilesvc-worker-inf2-device"][0]


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_only_the_worker_container_gets_a_token_to_annotate_its_pod(example: str) -> None:
    """workers.protectPods (default on): the worker patches its own pod's annotations while compiling
    (workers/host/pod_protection.py). Its token is projected into the worker container alone: the compile
    container, which runs the submitted model, has no way to the Kubernetes API."""
    docs = rendered(example)
    role = next(d for d in docs if d["kind"] == "Role" and d["metadata"]["name"].endswith("-worker-pods"))
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]}]
    binding = next(d for d in docs if d["kind"] == "RoleBinding")
    assert binding["subjects"][0]["name"].endswith("-worker")
    for name, spec in pod_specs(docs).items():
        if "-worker-" not in name:
            continue
        assert spec["automountServiceAccountToken"] is False
        for container in containers(spec):
            mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
            env = {e["name"] for e in container.get("env", [])}
            if container["name"] == "worker":
                assert "/var/run/secrets/kubernetes.io/serviceaccount" in mounts
                assert {"COMPILESVC_KUBERNETES_PROTECT", "POD_NAME", "POD_NAMESPACE"} <= env
            else:  # the compile container: the egress proof's settings only (tests/deploy/test_egress_chart.py)
                assert "/var/run/secrets/kubernetes.io/serviceaccount" not in mounts, container["name"]
                assert env <= {"COMPILESVC_EGRESS_CANARIES", "COMPILESVC_EGRESS_ACKNOWLEDGED"}, container["name"]

    values = values_of(example)
    values.setdefault("workers", {})["protectPods"] = False
    off = tuple(render(values))
    assert not [d for d in off if d["kind"] in ("Role", "RoleBinding")]
    assert "kube-api" not in json.dumps(off)


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_the_pod_splits_compile_container_is_a_native_sidecar(example: str) -> None:
    """Stopped by the kubelet only after the worker has exited (Kubernetes docs, "Sidecar containers"): a
    draining worker's compile runs on, and a scaledJob pod completes when its worker exits (--max-compiles 1)."""
    values = merged_values(example)
    split = 0
    for name, spec in pod_specs(rendered(example)).items():
        if "-worker-" not in name:
            continue
        sidecars = spec.get("initContainers", [])
        if any(c["name"] == "compile" for c in sidecars):
            split += 1
            assert [(c["name"], c["restartPolicy"]) for c in sidecars] == [("compile", "Always")]
        assert [c["name"] for c in spec["containers"]] == ["worker"], name
    default = values["workers"]["defaults"]["sandbox"]
    assert split == sum(1 for p in pools(example) if p.get("sandbox", default) == "pod")


# -- the pod-protection admission policy ------------------------------------------------------------------------

def _policy(docs: tuple[dict[str, Any], ...] | list[dict[str, Any]]) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == "ValidatingAdmissionPolicy")


def _cel(expression: str, activation: dict[str, Any]) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(expression)).evaluate(
        {name: celpy.json_to_cel(value) for name, value in activation.items()})


def admission(policy: dict[str, Any], request: dict[str, Any], old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What the API server would answer (the messages of the failed validations; [] admits), evaluating the
    policy's CEL as ValidatingAdmissionPolicy does: matchConditions first, then variables, then validations."""
    activation = {"request": request, "object": new, "oldObject": old}
    if not all(_cel(c["expression"], activation) for c in policy["spec"]["matchConditions"]):
        return []  # not the worker: the policy does not apply
    variables: dict[str, Any] = {}
    for variable in policy["spec"]["variables"]:
        variables[variable["name"]] = json.loads(json.dumps(
            _cel(variable["expression"], {**activation, "variables": variables}), default=_plain))
    return [v["message"] for v in policy["spec"]["validations"]
            if not _cel(v["expression"], {**activation, "variables": variables})]


def _plain(value: Any) -> Any:
    return dict(value) if isinstance(value, dict) else list(value)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (PatchType.MERGE, what workers/host/pod_protection.py sends)."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def a_worker_pod(docs: tuple[dict[str, Any], ...], name: str) -> dict[str, Any]:
    """A pod as the ReplicaSet controller makes it from the chart's worker Deployment."""
    deployment = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "compilesvc-worker-cpu")
    template = copy.deepcopy(deployment["spec"]["template"])
    metadata = {**template["metadata"], "name": name, "namespace": "compilesvc", "uid": f"uid-{name}",
                "labels": {**template["metadata"]["labels"], "pod-template-hash": "7d9f8c6b5"},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "uid": "rs-uid",
                                     "name": "compilesvc-worker-cpu-7d9f8c6b5", "controller": True,
                                     "blockOwnerDeletion": True}]}
    spec = {**template["spec"], "nodeName": "ip-10-0-1-7"}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def the_workers_request(pod: str | None) -> dict[str, Any]:
    extra = {} if pod is None else {"authentication.kubernetes.io/pod-name": [pod],
                                    "authentication.kubernetes.io/pod-uid": [f"uid-{pod}"],
                                    "authentication.kubernetes.io/node-name": ["ip-10-0-1-7"]}
    return {"operation": "UPDATE", "namespace": "compilesvc", "name": "",
            "userInfo": {"username": "system:serviceaccount:compilesvc:compilesvc-worker", "uid": "sa-uid",
                         "groups": ["system:serviceaccounts", "system:serviceaccounts:compilesvc",
                                    "system:authenticated"],
                         "extra": extra}}


@pytest.mark.parametrize("version", ["1.30.0", KUBERNETES_VERSION])
def test_the_pod_protection_policy_validates_for_every_version_we_support(version: str) -> None:
    docs = rendered("minimal")
    found = [d for d in docs if d["kind"] in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")]
    assert [d["apiVersion"] for d in found] == ["admissionregistration.k8s.io/v1"] * 2
    for doc in found:
        kubernetes_validate.validate(doc, version, strict=True)
    policy, binding = found
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    values = values_of("minimal")
    values.setdefault("workers", {})["podProtectionPolicy"] = False
    assert not [d for d in render(values) if d["kind"].startswith("ValidatingAdmissionPolicy")]
    values["workers"] = {"protectPods": False}  # no Role to narrow: no policy either
    assert not [d for d in render(values) if d["kind"].startswith("ValidatingAdmissionPolicy")]


def test_the_pod_protection_policy_admits_the_workers_own_patch_and_nothing_else() -> None:
    """The policy's CEL, evaluated offline (cel-python) on requests as the API server builds them from the
    worker's merge patch (workers/host/pod_protection.py pod_annotations(), applied as RFC 7386 says)."""
    docs = rendered("minimal")
    policy = _policy(docs)
    mine, other = "compilesvc-worker-cpu-7d9f8c6b5-x2k4p", "compilesvc-worker-cpu-7d9f8c6b5-q9w3z"
    pod = a_worker_pod(docs, mine)
    pod["metadata"]["annotations"]["kubectl.kubernetes.io/restartedAt"] = "2026-11-26T17:00:00Z"
    request = the_workers_request(mine)

    def patched(old: dict[str, Any], running: int) -> dict[str, Any]:
        return merge_patch(old, {"metadata": {"annotations": pod_protection.pod_annotations(running)}})

    busy = patched(pod, 1)
    assert busy["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "true"
    assert admission(policy, request, pod, busy) == []  # protected while compiling
    idle = patched(busy, 0)
    assert "karpenter.sh/do-not-disrupt" not in idle["metadata"]["annotations"]
    assert admission(policy, request, busy, idle) == []  # and back
    assert admission(policy, request, pod, patched(pod, 0)) == []  # a restarted worker's first patch

    other_pod = a_worker_pod(docs, other)
    refused = admission(policy, request, other_pod, patched(other_pod, 1))
    assert refused == ["the compilesvc worker may annotate only its own pod (its token is not bound to this one)"]
    assert admission(policy, the_workers_request(None), pod, busy) == refused  # a token bound to no pod

    sneaky = merge_patch(busy, {"metadata": {"annotations": {"cluster-autoscaler.kubernetes.io/safe-to-evict": "no"}}})
    assert admission(policy, request, busy, sneaky) == [
        "the compilesvc worker may change only the pod-deletion-cost and karpenter.sh/do-not-disrupt annotations"]
    dropped = merge_patch(busy, {"metadata": {"annotations": {"kubectl.kubernetes.io/restartedAt": None}}})
    assert len(admission(policy, request, busy, dropped)) == 1
    relabelled = merge_patch(busy, {"metadata": {"labels": {"app.kubernetes.io/component": "api"}}})
    assert admission(policy, request, busy, relabelled) == [
        "the compilesvc worker may change nothing of a pod but its two protection annotations"]
    reimaged = copy.deepcopy(busy)
    reimaged["spec"]["containers"][0]["image"] = "attacker/image:latest"
    assert len(admission(policy, request, busy, reimaged)) == 1
    for value in ({"controller.kubernetes.io/pod-deletion-cost": "2147483647"}, {"karpenter.sh/do-not-disrupt": "x"}):
        assert len(admission(policy, request, pod, merge_patch(pod, {"metadata": {"annotations": value}}))) == 1

    # Anyone else (the ReplicaSet controller, an operator) is not the policy's business.
    kubectl = {**request, "userInfo": {"username": "admin", "groups": ["system:masters"], "extra": {}}}
    assert admission(policy, kubectl, busy, relabelled) == []


def relay_container(values: dict[str, Any]) -> dict[str, Any]:
    relay = next(d for d in render(values) if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-relay"))
    return dict(next(c for c in relay["spec"]["template"]["spec"]["containers"] if c["name"] == "relay"))


def test_the_relay_serves_its_metrics_on_its_named_port_unless_turned_off() -> None:
    values = values_of("minimal")
    container = relay_container(values)
    assert container["ports"] == [{"name": "metrics", "containerPort": 9102, "protocol": "TCP"}]
    assert {"name": "COMPILESVC_RELAY_METRICS_PORT", "value": "9102"} in container["env"]
    values["relay"] = {**values.get("relay", {}), "metricsPort": 0}
    off = relay_container(values)
    assert "ports" not in off and not any(e["name"] == "COMPILESVC_RELAY_METRICS_PORT" for e in off["env"])


def test_every_worker_is_probed_for_consuming() -> None:
    """The worker's livenessProbe reads the liveness file its canary check writes (workers/liveness.py), with
    the stdlib-only probe (compilesvc/liveness.py), the same signal as compose's healthcheck."""
    specs = pod_specs(rendered("eks-neuron-keda"))
    for pool in pools("eks-neuron-keda"):
        worker = next(c for c in specs[f"compilesvc-worker-{pool['name']}"]["containers"] if c["name"] == "worker")
        probe = worker["livenessProbe"]
        assert probe["exec"]["command"] == ["python", "-m", "compilesvc.liveness", "worker"], pool["name"]
        assert probe["timeoutSeconds"] < probe["periodSeconds"]
