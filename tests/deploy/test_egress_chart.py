"""The chart renders the egress proof's canaries (workers/isolation/egress.py) into the container whose network
is the compile's: the compile runner's (pod pools), the worker's (bwrap pools, which probe from inside their
sandbox). The runner refuses service settings in its environment (workers.isolation.compile_runner): these two
are its own and must pass that check."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.test_helm_chart import EXAMPLES, pod_specs, render, rendered, values_of
from workers.isolation import egress
from workers.isolation.compile_runner import refused_environment


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def _compile_envs(docs: tuple[dict[str, Any], ...] | list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    found = {}
    for name, spec in pod_specs(docs).items():
        for container in spec.get("initContainers", []):
            if container["name"] == "compile":
                found[name] = _env(container)
    return found


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_every_compile_runner_gets_the_canaries_and_nothing_it_refuses(example: str) -> None:
    values = values_of(example)
    envs = _compile_envs(rendered(example))
    assert envs
    for name, env in envs.items():
        assert set(env) == {egress.CANARIES_ENV}, name  # no acknowledgement unless the operator sets it
        assert refused_environment(env) == [], name
        canaries = egress.parse_canaries(env[egress.CANARIES_ENV])
        database = values["database"]
        assert ("compilesvc-api", 8080) in canaries and (database["host"], database.get("port", 5432)) in canaries
        assert any(port in (443, 8333) for _, port in canaries)  # the store
        assert any(port == 6379 for _, port in canaries), "the example lists its broker"


def test_the_store_endpoint_the_extra_canaries_and_the_acknowledgement() -> None:
    values = values_of("minimal")
    values["config"]["s3EndpointUrl"] = "https://minio.storage:9000"
    values["workers"] = {"egress": {"canaries": ["redis:6379", "compilesvc-api:8080"], "acknowledged": True}}
    env = next(iter(_compile_envs(render(values)).values()))
    assert env[egress.CANARIES_ENV].split(",") == [
        "compilesvc-api:8080", "postgres.databases.svc.cluster.local:5432", "minio.storage:9000", "redis:6379"]
    assert env[egress.ACKNOWLEDGED_ENV] == "1" and refused_environment(env) == []
    values["config"]["s3EndpointUrl"] = "http://seaweedfs"
    env = next(iter(_compile_envs(render(values)).values()))
    assert "seaweedfs:80" in env[egress.CANARIES_ENV].split(",")


def test_a_bwrap_pool_s_worker_gets_the_canaries() -> None:
    values = values_of("minimal")
    values["workers"] = {"pools": [{"name": "cpu", "target": "cpu", "release": "2.13.0",
                                    "queues": ["compile.cpu.2.13.0"], "sandbox": "bwrap"}]}
    spec = pod_specs(render(values))["compilesvc-worker-cpu"]
    assert "initContainers" not in spec or not spec["initContainers"]
    env = _env(spec["containers"][0])
    assert egress.parse_canaries(env[egress.CANARIES_ENV])[0] == ("compilesvc-api", 8080)
    assert egress.ACKNOWLEDGED_ENV not in env


def test_a_malformed_canary_is_refused_at_render() -> None:
    values = values_of("minimal")
    values["workers"] = {"egress": {"canaries": ["redis"]}}
    with pytest.raises(Exception, match="canaries"):
        render(values)
