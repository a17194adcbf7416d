"""The rendered chart against what EKS, the kubelet, Karpenter, KEDA and Pod Security Admission do to it
(issue 38): the doubles of tests/deploy/platform.py, each citing its source, applied to every values file
of deploy/helm/examples."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy import platform
from tests.deploy.test_helm_chart import (
    EXAMPLES,
    KARPENTER,
    containers,
    helm,
    merged_values,
    pod_specs,
    pools,
    render,
    rendered,
    validate,
    values_of,
)
from workers.isolation.compile_runner import TOKEN_FILES, refused_environment

MODES: tuple[platform.Mode, ...] = ("irsa", "pod-identity")


def worker_pods(example: str) -> dict[str, dict[str, Any]]:
    """Each worker pool's pod as its controller creates it (metadata from the template, the template's spec)."""
    found = {}
    for doc in rendered(example):
        if doc["kind"] == "Deployment" and "-worker-" in doc["metadata"]["name"]:
            template = doc["spec"]["template"]
        elif doc["kind"] == "ScaledJob":
            template = doc["spec"]["jobTargetRef"]["template"]
        else:
            continue
        found[doc["metadata"]["name"]] = {"metadata": copy.deepcopy(template["metadata"]),
                                          "spec": copy.deepcopy(template["spec"])}
    return found


def credentials_of(container: dict[str, Any]) -> tuple[list[str], list[str]]:
    """What the compile runner refuses in a container: its environment's names, and the token files mounted."""
    env = {e["name"]: e.get("value", "") for e in container.get("env", [])}
    mounts = [m["mountPath"] for m in container.get("volumeMounts", [])]
    tokens = [str(t) for t in TOKEN_FILES if any(str(t).startswith(m.rstrip("/") + "/") for m in mounts)]
    return refused_environment(env), tokens


# -- the pod-identity webhook ------------------------------------------------------------------------------------

def test_the_webhook_double_mutates_the_upstream_fixture_as_upstream_expects() -> None:
    """pkg/handler/testdata/rawPodWithInitContainer.pod.yaml: an init container, a native sidecar and a container
    all get the region pair, the role and the token file, and the token volume's mount."""
    pod: dict[str, Any] = {"metadata": {"name": "p"}, "spec": {
        "initContainers": [{"name": "initcontainer"}, {"name": "sidecar", "restartPolicy": "Always"}],
        "containers": [{"name": "balajilovesoreos"}]}}
    mutated = platform.pod_identity_webhook(pod, "irsa", "arn:aws:iam::111122223333:role/s3-reader", "seattle")
    for container in containers(mutated["spec"]):
        assert [(e["name"], e["value"]) for e in container["env"]] == [
            ("AWS_DEFAULT_REGION", "seattle"), ("AWS_REGION", "seattle"),
            ("AWS_ROLE_ARN", "arn:aws:iam::111122223333:role/s3-reader"),
            ("AWS_WEB_IDENTITY_TOKEN_FILE", "/var/run/secrets/eks.amazonaws.com/serviceaccount/token")]
        assert container["volumeMounts"] == [{"name": "aws-iam-token", "readOnly": True,
                                              "mountPath": "/var/run/secrets/eks.amazonaws.com/serviceaccount"}]
    assert mutated["spec"]["volumes"][0]["name"] == "aws-iam-token"
    pod["metadata"]["annotations"] = {platform.SKIP_CONTAINERS: "sidecar,initcontainer"}  # rawPodSkip
    skipped = platform.pod_identity_webhook(pod, "pod-identity")
    assert [bool(c.get("env")) for c in containers(skipped["spec"])] == [False, False, True]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_with_the_webhook_the_compile_container_gets_no_credential_and_the_worker_does(
        example: str, mode: platform.Mode) -> None:
    pods = worker_pods(example)
    assert pods
    for name, pod in pods.items():
        mutated = platform.pod_identity_webhook(pod, mode)
        by_name = {c["name"]: c for c in containers(mutated["spec"])}
        variables, tokens = credentials_of(by_name["worker"])
        assert variables and len(tokens) == 1, name  # the worker reaches S3 with them
        if "compile" not in by_name:  # a bwrap pool: its compiles get child_env's allow-list only
            continue
        assert credentials_of(by_name["compile"]) == ([], []), name
        # The same pod without the annotation: the runner would refuse to start (exit 78) and crash-loop.
        bare = copy.deepcopy(pod)
        bare["metadata"]["annotations"].pop(platform.SKIP_CONTAINERS)
        unskipped = next(c for c in platform.pod_identity_webhook(bare, mode)["spec"]["initContainers"])
        variables, tokens = credentials_of(unskipped)
        assert variables and tokens, name


@pytest.mark.parametrize("mode", MODES)
def test_the_plain_manifest_s_compile_container_gets_no_credential_either(mode: platform.Mode) -> None:
    manifest = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "compile-worker-pod.yaml"
    deployment = next(d for d in yaml.safe_load_all(manifest.read_text()) if d and d["kind"] == "Deployment")
    mutated = platform.pod_identity_webhook(copy.deepcopy(deployment["spec"]["template"]), mode)
    by_name = {c["name"]: c for c in containers(mutated["spec"])}
    assert credentials_of(by_name["compile"]) == ([], []) and credentials_of(by_name["worker"])[1]


def test_a_pool_s_own_skip_containers_names_are_kept_with_the_compile_container() -> None:
    values = values_of("minimal")
    values["workers"] = {"pools": [{"name": "cpu", "target": "cpu", "release": "2.13.0",
                                    "queues": ["compile.cpu.2.13.0"],
                                    "podAnnotations": {platform.SKIP_CONTAINERS: "istio-proxy",
                                                       "example.com/team": "ml"}}]}
    deployment = next(d for d in render(values) if d["metadata"]["name"] == "compilesvc-worker-cpu")
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations[platform.SKIP_CONTAINERS] == "istio-proxy,compile"
    assert annotations["example.com/team"] == "ml" and "checksum/config" in annotations


# -- per-component pod settings ----------------------------------------------------------------------------------

COMPONENTS = {"api": "compilesvc-api", "proxy": "compilesvc-proxy", "relay": "compilesvc-relay",
              "gc": "compilesvc-gc", "migrations": "compilesvc-migrate"}


def test_every_component_takes_pod_annotations_labels_priority_runtime_affinity_and_spread() -> None:
    values = values_of("minimal")
    spread = [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway",
               "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "compilesvc"}}}]
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]}]}}}
    extra = {"podAnnotations": {"example.com/owner": "platform"}, "podLabels": {"example.com/cost": "ml"},
             "priorityClassName": "compilesvc-high", "runtimeClassName": "gvisor",
             "topologySpreadConstraints": spread, "affinity": affinity}
    for component in COMPONENTS:
        values[component] = {**values.get(component, {}), **extra}
    pool = {"name": "cpu", "target": "cpu", "release": "2.13.0", "queues": ["compile.cpu.2.13.0"],
            **extra}
    values["workers"] = {"pools": [pool]}
    docs = render(values)  # the schema takes them all
    for doc in docs:
        validate(doc)
    specs = pod_specs(docs)
    metadata = {}
    for doc in docs:
        if doc["kind"] in ("Deployment", "Job"):
            metadata[doc["metadata"]["name"]] = doc["spec"]["template"]["metadata"]
        elif doc["kind"] == "CronJob":
            metadata[doc["metadata"]["name"]] = doc["spec"]["jobTemplate"]["spec"]["template"]["metadata"]
    for name in [*COMPONENTS.values(), "compilesvc-worker-cpu"]:
        spec = specs[name]
        assert spec["priorityClassName"] == "compilesvc-high" and spec["runtimeClassName"] == "gvisor", name
        assert spec["topologySpreadConstraints"] == spread and spec["affinity"] == affinity, name
        assert metadata[name]["annotations"]["example.com/owner"] == "platform", name
        assert metadata[name]["labels"]["example.com/cost"] == "ml", name
        assert metadata[name]["labels"]["app.kubernetes.io/name"] == "compilesvc", name
    values["api"]["podLabels"] = {"app.kubernetes.io/component": "proxy"}  # would steal the proxy's Service
    with pytest.raises(helm.HelmRenderError, match=r"podLabels may not set app\.kubernetes\.io/component"):
        render(values)


# -- the kubelet's ephemeral-storage arithmetic ------------------------------------------------------------------

@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_every_pod_s_ephemeral_limit_covers_its_empty_dirs(example: str) -> None:
    """podEphemeralStorageLimitEviction evicts, without grace, once containers + emptyDirs pass the pod's
    limit (the containers' sum): the pod's limit must hold every emptyDir full, plus the containers' own."""
    for name, spec in pod_specs(rendered(example)).items():
        limit = platform.pod_ephemeral_limit(spec)
        assert limit is not None and limit >= platform.empty_dir_budget(spec) + 2**30, name
        for container in containers(spec):  # the scheduler reserves the container's own, not the volumes'
            request = container["resources"]["requests"]["ephemeral-storage"]
            assert platform.quantity(request) < platform.quantity(container["resources"]["limits"]["ephemeral-storage"])


def test_a_container_without_an_ephemeral_limit_fails_to_render_with_the_reason() -> None:
    values = values_of("minimal")
    values["proxy"] = {"resources": {"limits": {"ephemeral-storage": None}}}
    with pytest.raises(helm.HelmRenderError, match=r"proxy: resources.limits.ephemeral-storage is unset.*emptyDirs"):
        render(values)


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_a_compile_s_disk_limit_fires_before_the_kubelet_evicts(example: str) -> None:
    """COMPILESVC_SANDBOX_MAX_DISK_MB times the pool's concurrency, with a model each, stays under the
    sizeLimit of the emptyDir the compile writes in (spool with the pod split, work with bwrap):
    emptyDirLimitEviction would otherwise evict the pod before the sandbox's SANDBOX_DISK_LIMIT."""
    upload = merged_values(example)["config"]["maxUploadBytes"]
    for pool in pools(example):
        spec = pod_specs(rendered(example))[f"compilesvc-worker-{pool['name']}"]
        worker = next(c for c in spec["containers"] if c["name"] == "worker")
        disk = int(next(e["value"] for e in worker["env"] if e["name"] == "COMPILESVC_SANDBOX_MAX_DISK_MB"))
        volume = "spool" if pool["sandbox"] == "pod" else "work"
        size = platform.quantity(next(v for v in spec["volumes"] if v["name"] == volume)["emptyDir"]["sizeLimit"])
        assert pool["concurrency"] * (disk * 2**20 + upload) < size, pool["name"]


def test_a_disk_limit_the_work_directory_cannot_hold_fails_to_render() -> None:
    values = values_of("minimal")
    values["workers"] = {"pools": [{"name": "cpu", "target": "cpu", "release": "2.13.0",
                                    "queues": ["compile.cpu.2.13.0"], "workSizeLimit": "20Gi",
                                    "sandboxMaxDiskMb": 20480}]}
    with pytest.raises(helm.HelmRenderError, match=r"sandboxMaxDiskMb \(20480\) is more than its work directory"):
        render(values)
    values["workers"]["pools"][0]["workSizeLimit"] = "8Gi"  # not even the model fits
    with pytest.raises(helm.HelmRenderError, match="leaves no disk for a compile"):
        render(values)
    values = values_of("minimal")
    values["config"]["extra"] = {"COMPILESVC_SANDBOX_MAX_DISK_MB": "999999"}
    with pytest.raises(helm.HelmRenderError, match="sandboxMaxDiskMb instead"):
        render(values)


# -- rollouts, capacity, Jobs ------------------------------------------------------------------------------------

@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_a_worker_rollout_starts_new_pods_before_draining_old_ones(example: str) -> None:
    for doc in rendered(example):
        if doc["kind"] == "Deployment" and "-worker-" in doc["metadata"]["name"]:
            assert doc["spec"]["strategy"] == {"type": "RollingUpdate",
                                               "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}


def test_a_pool_may_keep_its_running_compiles_through_a_config_change() -> None:
    values = values_of("minimal")
    values["workers"] = {"pools": [{"name": "cpu", "target": "cpu", "release": "2.13.0",
                                    "queues": ["compile.cpu.2.13.0"], "restartOnConfigChange": False}]}
    before = next(d for d in render(values) if d["metadata"]["name"] == "compilesvc-worker-cpu")
    values["config"]["logLevel"] = "DEBUG"
    docs = render(values)
    after = next(d for d in docs if d["metadata"]["name"] == "compilesvc-worker-cpu")
    assert "checksum/config" not in after["spec"]["template"]["metadata"]["annotations"]
    assert before["spec"]["template"] == after["spec"]["template"]  # nothing for the Deployment to roll
    api = next(d for d in docs if d["metadata"]["name"] == "compilesvc-api")
    assert "checksum/config" in api["spec"]["template"]["metadata"]["annotations"]


def test_long_compile_pools_run_on_on_demand_capacity() -> None:
    """A spot node gets two minutes' notice (Karpenter's interruption handling drains it): only a pool whose
    worker grace fits that may run on a NodePool that allows spot (karpenter.sh/capacity-type)."""
    nodepools = {d["metadata"]["name"]: d for d in yaml.safe_load_all(KARPENTER.read_text())
                 if d and d["kind"] == "NodePool"}
    spot = {name for name, pool in nodepools.items()
            for r in pool["spec"]["template"]["spec"]["requirements"]
            if r["key"] == "karpenter.sh/capacity-type" and "spot" in r["values"]}
    for example in EXAMPLES:
        for name, spec in pod_specs(rendered(example)).items():
            if spec.get("nodeSelector", {}).get("karpenter.sh/nodepool") in spot:
                assert spec["terminationGracePeriodSeconds"] <= 120, (example, name)
    assert "compilesvc-compile" not in spot


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_compile_containers_have_guaranteed_memory(example: str) -> None:
    for name, spec in pod_specs(rendered(example)).items():
        for container in spec.get("initContainers", []):
            if container["name"] == "compile":
                resources = container["resources"]
                assert resources["requests"]["memory"] == resources["limits"]["memory"], name


def test_a_scaled_job_outlives_no_compile_and_its_drain() -> None:
    values = merged_values("scaledjob")
    scaled = next(d for d in rendered("scaledjob") if d["kind"] == "ScaledJob")
    floor = values["compileTimeoutSeconds"] + values["drainWindowSeconds"] + values["graceMarginSeconds"]
    assert scaled["spec"]["jobTargetRef"]["activeDeadlineSeconds"] >= floor
    broken = values_of("scaledjob")
    broken["workers"]["pools"][0]["scaling"]["activeDeadlineSeconds"] = values["compileTimeoutSeconds"]
    with pytest.raises(helm.HelmRenderError, match=r"activeDeadlineSeconds \(\d+\) is less than compileTimeoutSeconds"):
        render(broken)


# -- probes and termination --------------------------------------------------------------------------------------

@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_api_and_proxy_keep_serving_while_their_endpoints_are_removed(example: str) -> None:
    specs = pod_specs(rendered(example))
    for name in ("compilesvc-api", "compilesvc-proxy"):
        if name not in specs:
            continue
        container = specs[name]["containers"][0]
        pause = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert pause >= 5 and specs[name]["terminationGracePeriodSeconds"] >= pause + 30, name


# -- Pod Security Admission ---------------------------------------------------------------------------------------

def test_only_a_bwrap_worker_needs_a_privileged_namespace() -> None:
    """Pod Security Admission applies one level per namespace: a bwrap pool (seccomp and AppArmor Unconfined,
    /proc Unmasked) fails Baseline, every other pod passes Restricted, so bwrap pools go in a namespace of
    their own (docs/kubernetes.md, "bwrap pools")."""
    for example in EXAMPLES:
        for name, spec in pod_specs(rendered(example)).items():
            assert platform.pod_security_violations(spec, "restricted") == [], (example, name)
    values = values_of("minimal")
    values["workers"] = {"pools": [{"name": "cpu", "target": "cpu", "release": "2.13.0",
                                    "queues": ["compile.cpu.2.13.0"], "sandbox": "bwrap"}]}
    bwrap = pod_specs(render(values))["compilesvc-worker-cpu"]
    assert platform.pod_security_violations(bwrap, "baseline") == [
        "worker: seccompProfile Unconfined", "worker: appArmorProfile Unconfined", "worker: procMount Unmasked"]


def test_bwrap_pools_render_as_a_release_of_workers_alone() -> None:
    """The second release of docs/kubernetes.md's "bwrap pools": its namespace is privileged, so it holds
    nothing but the bwrap workers (no API, proxy, relay, gc or migration hook)."""
    values = values_of("minimal")
    values.update({"api": {"enabled": False}, "proxy": {"enabled": False}, "relay": {"enabled": False},
                   "migrations": {"enabled": False}, "gc": {"enabled": False},
                   "workers": {"pools": [{"name": "bwrap", "target": "cpu", "release": "2.13.0",
                                          "queues": ["compile.cpu.2.13.0"], "sandbox": "bwrap"}]}})
    docs = render(values)
    for doc in docs:
        validate(doc)
    assert set(pod_specs(docs)) == {"compilesvc-worker-bwrap"}
    accounts = {d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"}
    assert accounts == {"compilesvc-worker"}
    assert not [d for d in docs if d["kind"] in ("Service", "PodDisruptionBudget", "ServiceMonitor")]
    egress = next(d for d in docs if d["metadata"]["name"] == "compilesvc-egress")["spec"]["egress"]
    to_api = [rule for rule in egress for peer in rule["to"]
              if peer.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component") == "api"]
    assert to_api == []  # no rule to an API this release lacks
    values["proxy"] = {"enabled": True}
    with pytest.raises(helm.HelmRenderError, match=r"proxy\.enabled needs api\.enabled"):
        render(values)


def test_the_docs_say_how_each_item_was_checked() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "kubernetes.md").read_text()
    for phrase in ("eks.amazonaws.com/skip-containers", "Ephemeral storage", "restartOnConfigChange",
                   "preStopSeconds", "activeDeadlineSeconds", "bwrap pools", "How each item is checked"):
        assert phrase in text, phrase
