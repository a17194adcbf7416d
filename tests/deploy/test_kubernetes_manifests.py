"""deploy/kubernetes/: the pod-level compile split (docs/deploy.md, "Compile isolation"), checked offline.

Every document validates strictly against the Kubernetes API schema (kubernetes-validate), and the layout
holds what the split stands on: the compile container gets no secret, no setting and no token, runs
unprivileged on a read-only root, sees the models read-only, and its runner would start with what the
manifest gives it (it refuses service settings: workers.isolation.compile_runner).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from compilesvc.config.settings import Settings
from workers.isolation.compile_runner import refused_environment

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "compile-worker-pod.yaml"


def documents() -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc]


def pod_spec() -> dict[str, Any]:
    deployment = next(d for d in documents() if d["kind"] == "Deployment")
    return dict(deployment["spec"]["template"]["spec"])


def container(name: str) -> dict[str, Any]:
    spec = pod_spec()
    return next(c for c in [*spec.get("initContainers", []), *spec["containers"]] if c["name"] == name)


def test_the_compile_container_outlives_the_worker() -> None:
    """A native sidecar: the kubelet stops it only after the worker has exited (Kubernetes docs, "Sidecar
    containers"), so a SIGTERMed pod's worker can drain while its compile runs on."""
    spec = pod_spec()
    assert [c["name"] for c in spec["initContainers"]] == ["compile"]
    assert spec["initContainers"][0]["restartPolicy"] == "Always"
    assert [c["name"] for c in spec["containers"]] == ["worker"]


@pytest.mark.parametrize("document", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_each_document_validates_strictly(document: dict[str, Any]) -> None:
    kubernetes_validate.validate(document, kubernetes_validate.latest_version(), strict=True)


def test_the_compile_container_holds_no_secret_and_no_setting() -> None:
    spec, compile_ = pod_spec(), container("compile")
    assert spec["automountServiceAccountToken"] is False and spec["shareProcessNamespace"] is False
    assert "env" not in compile_ and "envFrom" not in compile_
    secret_volumes = {v["name"] for v in spec["volumes"] if "secret" in v}
    assert secret_volumes and not {m["name"] for m in compile_["volumeMounts"]} & secret_volumes
    # What it gets: the image's own variables (docker/Dockerfile*), none of which the runner refuses.
    image_env = {name: "x" for dockerfile in MANIFEST.parents[2].glob("docker/Dockerfile*")
                 for name in re.findall(r"^(?:ENV\s+|\s+)([A-Z][A-Z0-9_]*)=", dockerfile.read_text(), re.M)}
    assert "COMPILESVC_DATA_DIR" in image_env and refused_environment(image_env) == []
    worker_env = {e["name"]: e.get("value", "") for e in container("worker")["env"]}
    assert refused_environment(worker_env)  # the worker's own would be refused there


def test_the_compile_container_is_unprivileged_on_a_read_only_root_with_limits() -> None:
    compile_ = container("compile")
    context = compile_["securityContext"]
    assert context["runAsNonRoot"] and context["readOnlyRootFilesystem"]
    assert context["allowPrivilegeEscalation"] is False and context["capabilities"]["drop"] == ["ALL"]
    assert context["seccompProfile"]["type"] == "RuntimeDefault"
    assert {"memory", "cpu"} <= set(compile_["resources"]["limits"])
    assert compile_["command"][:3] == ["python", "-m", "workers.isolation.compile_runner"]


def test_the_spool_is_all_they_share_and_its_models_are_read_only_for_the_compile() -> None:
    mounts = {m["subPath"]: m for m in container("compile")["volumeMounts"]}
    assert set(mounts) == {"attempts", "runner", "models"}
    assert {m["name"] for m in mounts.values()} == {"spool"}
    assert mounts["models"].get("readOnly") is True
    assert not mounts["attempts"].get("readOnly") and not mounts["runner"].get("readOnly")
    spool = next(m for m in container("worker")["volumeMounts"] if m["name"] == "spool")
    for sub, mount in mounts.items():  # the same paths in both containers: the request names them
        assert mount["mountPath"] == f"{spool['mountPath']}/{sub}"


def test_the_worker_is_in_pod_mode_on_that_spool() -> None:
    env = {e["name"]: e.get("value") for e in container("worker")["env"]}
    settings = Settings(sandbox=env["COMPILESVC_SANDBOX"], compile_spool=env["COMPILESVC_COMPILE_SPOOL"])
    assert settings.sandbox == "pod" and str(settings.compile_spool) == "/spool"
    assert container("worker")["args"][:3] == ["worker", "--concurrency", "1"]


def test_the_network_policy_denies_ingress_and_bounds_egress() -> None:
    policy = next(d for d in documents() if d["kind"] == "NetworkPolicy")
    deployment = next(d for d in documents() if d["kind"] == "Deployment")
    assert policy["spec"]["podSelector"]["matchLabels"] == deployment["spec"]["template"]["metadata"]["labels"]
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"} and policy["spec"]["ingress"] == []
    ports = {p["port"] for rule in policy["spec"]["egress"] for p in rule["ports"]}
    assert ports == {5432, 6379, 8333, 53}
    assert all(rule.get("to") for rule in policy["spec"]["egress"])  # no rule open to everywhere
