"""A compiling worker's pod asks to be spared (workers/host/pod_protection.py, issue 30): the annotations on
its own pod follow its running compiles, through the Kubernetes API.

No cluster exists here; :class:`KubeApi` plays the one endpoint the worker uses as the Kubernetes API
reference describes it ("Pod v1 core", patch: ``PATCH /api/v1/namespaces/{namespace}/pods/{name}``), with a
JSON merge patch (``application/merge-patch+json``, RFC 7386: a null removes a key) and bearer-token
authentication; lightkube, the client the worker uses, talks to it through an ordinary kubeconfig."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.workers.conftest import Cluster, wait_for
from workers.host.pod_protection import DELETION_COST, DO_NOT_DISRUPT, PodProtection

MakeCluster = Callable[..., Cluster]
TOKEN = "test-service-account-token"


def merge(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """RFC 7386."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict):
            target[key] = merge(dict(target.get(key) or {}), value)
        else:
            target[key] = value
    return target


class KubeApi(ThreadingHTTPServer):
    def __init__(self, namespace: str, pod: str) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.path_of_pod = f"/api/v1/namespaces/{namespace}/pods/{pod}"
        self.pod: dict[str, Any] = {"apiVersion": "v1", "kind": "Pod",
                                    "metadata": {"name": pod, "namespace": namespace, "annotations": {}}}
        self.history: list[dict[str, str]] = []
        self.refuse = False

    @property
    def annotations(self) -> dict[str, str]:
        return dict(self.pod["metadata"].get("annotations") or {})

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": f"http://127.0.0.1:{self.server_address[1]}"}}],
            "users": [{"name": "worker", "user": {"token": TOKEN}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "worker"}}],
        }))
        return path


class _Handler(BaseHTTPRequestHandler):
    server: KubeApi

    def log_message(self, *args: object) -> None:
        pass

    def _answer(self, status: int, document: dict[str, Any]) -> None:
        data = json.dumps(document).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_PATCH(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._answer(401, {"kind": "Status", "code": 401, "reason": "Unauthorized"})
        if self.server.refuse:
            return self._answer(503, {"kind": "Status", "code": 503, "reason": "ServiceUnavailable"})
        if self.path.split("?")[0] != self.server.path_of_pod:
            return self._answer(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
        if self.headers.get("Content-Type") != "application/merge-patch+json":
            return self._answer(415, {"kind": "Status", "code": 415, "reason": "UnsupportedMediaType"})
        merge(self.server.pod, body)
        self.server.history.append(self.server.annotations)
        self._answer(200, self.server.pod)


@pytest.fixture
def kube() -> Iterator[KubeApi]:
    server = KubeApi("builds", "worker-cpu-7d9f-abcde")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_the_annotations_follow_the_running_compiles(kube: KubeApi, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", str(kube.kubeconfig(tmp_path / "kubeconfig")))
    monkeypatch.setenv("POD_NAME", "worker-cpu-7d9f-abcde")
    monkeypatch.setenv("POD_NAMESPACE", "builds")
    protection = PodProtection.from_environment().start()
    wait_for(lambda: kube.history, 10, "the start's patch")
    assert kube.annotations == {DELETION_COST: "0"}  # a restarted worker's pod starts unprotected
    protection.started()
    protection.started()
    wait_for(lambda: kube.annotations.get(DELETION_COST) == "2", 10, "two compiles' protection")
    assert kube.annotations[DO_NOT_DISRUPT] == "true"
    protection.ended()
    protection.ended()
    wait_for(lambda: kube.annotations == {DELETION_COST: "0"}, 10, "the protection to be lifted")

    kube.refuse = True  # the API away: the compile goes on, the patch is tried again
    protection.started()
    wait_for(lambda: protection.applied == 0 and not protection._changes.qsize(), 5, "the failed attempt")
    kube.refuse = False
    wait_for(lambda: kube.annotations.get(DO_NOT_DISRUPT) == "true", 30, "the retried patch")


def test_without_the_downward_api_the_worker_says_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POD_NAME", raising=False)
    monkeypatch.setenv("POD_NAMESPACE", "builds")
    with pytest.raises(ValueError, match="needs POD_NAME"):
        PodProtection.from_environment()


@pytest.mark.slow
def test_a_compiling_worker_protects_its_pod_and_lifts_it_when_idle(make_cluster: MakeCluster, kube: KubeApi,
                                                                     tmp_path: Path) -> None:
    cluster = make_cluster(kubernetes_protect=True, extra_env={
        "KUBECONFIG": str(kube.kubeconfig(tmp_path / "kubeconfig")),
        "POD_NAME": "worker-cpu-7d9f-abcde", "POD_NAMESPACE": "builds"})
    worker = cluster.start_worker("w1", concurrency=1)
    result = cluster.submit(cluster.hlo_spec("slow:3"))
    wait_for(lambda: worker.logged("compiler started"), 30, "the compiler to start")
    wait_for(lambda: kube.annotations.get(DO_NOT_DISRUPT) == "true", 10, "the pod's protection")
    assert kube.annotations[DELETION_COST] == "1"
    assert cluster.wait_artifact(result.artifact_key, ("published", "failed"), 60).state == "published"
    wait_for(lambda: kube.annotations == {DELETION_COST: "0"}, 10, "the protection to be lifted")
    assert {DELETION_COST: "1", DO_NOT_DISRUPT: "true"} in kube.history
