"""Trace by release (issue 28, deliverable 3): ``cpu_backend`` only where the release has it, and trace
compiles of older releases only on hosts with a Neuron device.

Sources: the keyword first appears in the SDK 2.21.0 trace API reference (aws-neuron/aws-neuron-sdk commit
752349fd "Neuron SDK Release 2.21.0", frameworks/torch/torch-neuronx/api-reference-guide/inference/
api-torch-neuronx-trace.rst: its parent's signature ends at ``inline_weights_to_neff=True``); before it a
device-less host cannot trace (aws-neuron-sdk#910). The Neuron TEST DOUBLE follows both
(tests/doubles/neuron/torch_neuronx). Real compile children and worker capability probes, no mocks.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from compilesvc.dispatch.routing import queue_name
from tests.doubles import neuron_double_env, with_devices
from tests.workers import REPO, run_child, text_inputs
from tests.workers.backends.test_neuron import _capabilities
from workers.isolation.child_env import child_environment_for


def _host(tmp_path: Path, sdk: str, devices: int) -> dict[str, str]:
    """A host of ``sdk`` with ``devices`` Neuron devices (device nodes our code finds, and the double's count)."""
    env = {**neuron_double_env(sdk=sdk, devices=0), **child_environment_for("trn1"),
           "COMPILESVC_NEURON_DEVICE_GLOB": str(tmp_path / "no-devices" / "neuron[0-9]*")}
    return with_devices(env, tmp_path, devices) if devices else env


def _trace(tmp_path: Path, name: str, env: dict[str, str], sdk: str, **fields: Any) -> Any:
    return run_child(tmp_path, name, env=env, backend="trace", target="trn1", sdk=sdk, args=[],
                     inputs=text_inputs(2, 16), **fields)


@pytest.mark.parametrize("release", ["2.19.0", "2.20.0"])
def test_the_double_has_no_cpu_backend_before_2_21(release: str) -> None:
    """What our backend meets on such a host: the keyword is Python's own TypeError (the real signature has
    no such parameter), and tracing without a device fails in the PJRT client (#910)."""
    code = ("import torch, torch_neuronx\n"
            "m = torch.nn.Linear(2, 2)\n"
            "try:\n"
            "    torch_neuronx.trace(m, torch.ones(1, 2), compiler_args=['--target', 'trn1'], cpu_backend=True)\n"
            "except TypeError as exc:\n"
            "    print('TypeError:', exc)\n"
            "try:\n"
            "    torch_neuronx.trace(m, torch.ones(1, 2), compiler_args=['--target', 'trn1'])\n"
            "except RuntimeError as exc:\n"
            "    print('RuntimeError:', exc)\n")
    env = neuron_double_env(sdk=release, devices=0)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "TypeError: trace() got an unexpected keyword argument 'cpu_backend'" in proc.stdout
    assert "RuntimeError: Bad StatusOr access" in proc.stdout and "num_devices > 0" in proc.stdout


def test_a_2_20_trace_on_a_device_host_passes_no_cpu_backend(tmp_path: Path) -> None:
    run = _trace(tmp_path, "dev", _host(tmp_path, "2.20.0", devices=1), "2.20.0")
    assert run.returncode == 0, run.describe()
    assert "cpu_backend=(not in this release) devices=1" in run.stdout
    assert run.result["versions"]["trace_lowering"] == "device"


def test_a_2_20_trace_on_a_device_less_host_is_a_misrouted_request(tmp_path: Path) -> None:
    """Routing keeps these compiles off device-less hosts; one that arrives anyway (a worker started some
    other way) is the host's fault, said before the SDK is called."""
    run = _trace(tmp_path, "nodev", _host(tmp_path, "2.20.0", devices=0), "2.20.0")
    assert run.returncode == 4, run.describe()
    assert run.result["code"] == "NEURON_DEVICE_REQUIRED"
    assert "SDK 2.20.0" in run.result["message"] and "2.21.0" in run.result["message"]
    assert "unexpected keyword" not in run.stdout + run.stderr


def test_a_2_21_style_release_still_traces_on_the_cpu_backend(tmp_path: Path) -> None:
    run = _trace(tmp_path, "cpu", _host(tmp_path, "2.27.1", devices=0), "2.27.1")
    assert run.returncode == 0, run.describe()
    assert "cpu_backend=True devices=0" in run.stdout
    assert run.result["versions"]["trace_lowering"] == "cpu_backend"


def test_workers_say_whether_they_have_a_device_and_serve_old_traces_only_then(tmp_path: Path) -> None:
    trace_queues = {queue_name("inf2", "2.19.0", "trace"), queue_name("inf2", "2.19.0", "trace", tp_degree=2)}
    bare = _capabilities(_host(tmp_path, "2.19.0", devices=0))
    assert bare["neuron"]["devices"] == 0
    assert not trace_queues & set(bare["queues"]) and queue_name("inf2", "2.19.0", "neuronx-cc") in bare["queues"]
    assert bare["backends"]["inf2"] == ["neuronx-cc"]
    assert any("need a host with a Neuron device" in warning for warning in bare["warnings"])

    device = _capabilities(_host(tmp_path, "2.19.0", devices=2))
    assert device["neuron"]["devices"] == 2
    assert trace_queues <= set(device["queues"]) and device["backends"]["inf2"] == ["neuronx-cc", "trace"]

    current = _capabilities(_host(tmp_path, "2.27.1", devices=0))  # cpu_backend: no device needed
    assert current["neuron"]["devices"] == 0 and queue_name("inf2", "2.27.1", "trace") in current["queues"]
