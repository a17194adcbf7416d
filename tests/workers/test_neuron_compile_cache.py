"""The Neuron persistent compile cache under our control (issue 28, deliverable 4).

Since SDK 2.23.0 NxD's ``ModelBuilder.trace`` compiles through ``neuron_xla_compile(use_cache=True,
cache_dir=None, ...)`` (aws-neuron/neuronx-distributed commit e834945, trace/model_builder.py
``submit_compilation_job_with_cache``): the cache sits wherever ``--cache_dir`` in NEURON_CC_FLAGS, else
NEURON_COMPILE_CACHE_URL, else ``/var/tmp/neuron-compile-cache`` says (aws-neuron-sdk neuron-caching.rst),
shared by every compile on the host and never bounded. The TEST DOUBLE's ModelBuilder emulates that cache
(tests/doubles/neuron/neuronx_distributed/trace/model_builder.py). Each compile must get its own cache in its
work directory, and a corrupt entry (``[NLA001] … json parse_error``, whose documented fix is deleting the
cache and retrying: aws-neuron-sdk neuron-framework-autoport.rst) must be retried, not cached as a failure.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from compilesvc.compiles import failures
from tests.doubles import neuron_double_env
from tests.workers import run_children, text_inputs
from tests.workers.conftest import Cluster
from workers.isolation.child_env import child_environment_for

MakeCluster = Callable[..., Cluster]
SDK = "2.27.1"  # ModelBuilder with the persistent cache (2.23+)
CACHE_LINE = re.compile(r"Compile cache path: (\S+)")


def test_two_tp_compiles_on_one_host_share_no_cache_path(tmp_path: Path, tiny_torch_model: Path) -> None:
    shared = tmp_path / "operator-cache"
    env = {**neuron_double_env(sdk=SDK, devices=0), **child_environment_for("trn1"),
           "COMPILESVC_NEURON_DEVICE_GLOB": str(tmp_path / "no-devices" / "neuron[0-9]*"),
           # An operator's cache setting, which the SDK would prefer over NEURON_COMPILE_CACHE_URL.
           "NEURON_CC_FLAGS": f"--cache_dir={shared} --verbose=info"}
    fields = {"backend": "trace", "target": "trn1", "sdk": SDK, "tp_degree": 2, "model_path": str(tiny_torch_model),
              "model_format": "exported-program", "inputs": text_inputs(2, 16), "args": ["--double-behaviour=slow:2"]}
    runs = run_children(tmp_path, [("first", fields), ("second", fields)], env=env)
    caches = []
    for run in runs:
        assert run.returncode == 0, run.describe()
        [path] = CACHE_LINE.findall(run.stdout)
        cache = Path(path)
        assert cache.is_relative_to(run.work_dir), (cache, run.work_dir)
        entries = list(cache.glob("neuronxcc-*/MODULE_*"))
        assert len(entries) == 1 and (entries[0] / "model.done").exists()  # it really was the cache used
        assert not list(cache.rglob("*.lock"))
        caches.append(cache)
    assert caches[0] != caches[1] and not caches[0].is_relative_to(caches[1])
    assert not shared.exists()  # the operator's shared cache is not written


def test_a_corrupt_cache_entry_is_retried_and_then_succeeds(make_cluster: MakeCluster, tiny_torch_model: Path,
                                                            tmp_path: Path) -> None:
    # Unsandboxed: the double's once-marker must be visible to both attempts (a sandbox shows a compile only
    # its own directories).
    cluster = make_cluster(sandbox="off")
    marker = tmp_path / "corrupt-cache-once"
    cluster.start_worker("w", concurrency=1, env={
        **neuron_double_env(cluster.env, sdk=SDK), "COMPILESVC_NEURON_DOUBLE_CORRUPT_CACHE_ONCE": str(marker)})
    cluster.start_relay()
    uri = cluster.upload(tiny_torch_model.read_bytes(), "tiny.pt2")
    result = cluster.submit({"model": {"uri": uri, "format": "exported-program", "name": "tiny"}, "target": "inf2",
                             "sdk": SDK, "compiler": {"tp_degree": 2, "args": ["--double-behaviour=corrupt-cache"]},
                             "buckets": [{"batch_size": 1, "seq_len": 8}]})
    artifact = cluster.wait_artifact(result.artifact_key, ("published", "failed"), timeout=180)
    bucket = cluster.bucket(result.buckets[0].key)
    assert artifact.state == "published", bucket.error_message
    assert marker.exists() and bucket.attempts == 2
    with cluster.services.sessions() as session:
        [first] = failures.of_buckets(session, [bucket.id])[bucket.id]
    assert (first.attempt, first.error_class, first.code, first.retry) == (1, "infra", "COMPILE_CACHE_CORRUPT", True)
    assert "[NLA001]" in (first.message or "") and "parse_error" in (first.message or "")
