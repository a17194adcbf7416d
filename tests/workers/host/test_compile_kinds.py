"""Which kinds of Neuron compile a worker offers (issue 28, deliverable 1): those its release ships
(:func:`compilesvc.spec.neuron_kinds.release_kinds`, the function specs are checked with) whose packages
the host has. Against the Neuron SDK TEST DOUBLE: SDK 2.32.0's manifest (n2-manifest.json, manifest_version
2.32.0) lists neuronx-cc and no torch-neuronx or neuronx_distributed, and the double installs just that.
"""

from __future__ import annotations

from pathlib import Path

from compilesvc.dispatch.routing import queue_name
from compilesvc.spec.neuron_kinds import release_kinds
from tests.workers.host.test_toolchain import capabilities, host, start_worker
from workers.host.capabilities import capability_queues

TARGETS = ["inf2", "trn1", "trn2", "trn3"]  # 2.32.0's neuronx-cc supported_instances (n2-manifest.json)


def neuron_queues(caps: dict[str, object]) -> list[str]:
    return [q for q in capability_queues(caps) if not q.startswith("compile.cpu.")]  # type: ignore[arg-type]


def test_a_2_32_0_host_offers_hlo_compiles_only(tmp_path: Path) -> None:
    caps = capabilities(host(tmp_path, sdk="2.32.0"))
    assert caps["neuron"]["refused"] == []
    assert caps["neuron"]["packages"]["torch-neuronx"] is None
    assert caps["neuron"]["kinds"] == list(release_kinds("2.32.0")) == ["neuronx-cc", "neuronx-cc-tp"]
    assert [t for t in caps["targets"] if t != "cpu"] == TARGETS
    assert all(caps["backends"][t] == ["neuronx-cc"] for t in TARGETS)
    assert neuron_queues(caps) == sorted(queue_name(t, "2.32.0", "neuronx-cc", tp_degree=tp)
                                         for t in TARGETS for tp in (1, 2))
    # Why trace is not offered: the release, not the host (naming the package it lacks).
    assert any("Neuron SDK 2.32.0 ships no torch-neuronx" in w for w in caps["warnings"])


def test_a_host_with_neuronx_cc_alone_offers_hlo_for_a_release_that_ships_more(tmp_path: Path) -> None:
    caps = capabilities(host(tmp_path, sdk="2.27.1", without=("torch_neuronx", "neuronx_distributed")))
    assert caps["neuron"]["refused"] == [] and caps["neuron"]["kinds"] == ["neuronx-cc", "neuronx-cc-tp"]
    assert "compile.inf2.2.27.0.neuronx-cc" in neuron_queues(caps)
    assert not [q for q in neuron_queues(caps) if ".trace" in q]
    assert any("trace compiles not offered: missing torch_neuronx" in w for w in caps["warnings"])


def test_trace_without_neuronx_distributed_is_offered_at_tp_1_only(tmp_path: Path) -> None:
    caps = capabilities(host(tmp_path, sdk="2.27.1", without=("neuronx_distributed",)))
    assert caps["neuron"]["kinds"] == ["neuronx-cc", "neuronx-cc-tp", "trace"]
    assert "compile.trn2.2.27.0.trace" in neuron_queues(caps)
    assert "compile.trn2.2.27.0.trace-tp" not in neuron_queues(caps)


def test_a_2_32_0_host_with_a_stray_torch_neuronx_is_refused(tmp_path: Path) -> None:
    # Its packages are not 2.32.0's (which ships none): the key would lie about the toolchain.
    proc = start_worker(tmp_path, host(tmp_path, sdk="2.32.0", installed="2.27.1"))
    assert proc.returncode == 78, proc.stderr
    assert "torch-neuronx: installed 2.9.0.2.11.19912" in proc.stderr
    assert "release 2.32.0 ships nothing" in proc.stderr


def test_a_2_32_0_worker_passes_its_start_checks(tmp_path: Path) -> None:
    """(It then fails for want of a ledger and broker: none is reachable here.)"""
    proc = start_worker(tmp_path, host(tmp_path, sdk="2.32.0"))
    assert proc.returncode != 78, proc.stderr


def test_a_host_offers_the_targets_its_release_supports(tmp_path: Path) -> None:
    # Issue 28 (2): trn3 is an instance family of neuronx-cc from 2.29.0 in the SDK's manifest; a 2.28.0 host
    # offers no trn3 and says why, a 2.29.0 host (the double's compiler takes --target trn3 from then) does.
    before = capabilities(host(tmp_path, sdk="2.28.0"))
    assert [t for t in before["targets"] if t != "cpu"] == ["inf2", "trn1", "trn2"]
    assert any("Neuron SDK 2.28.0 does not support target(s) trn3" in w for w in before["warnings"])
    after = capabilities(host(tmp_path, sdk="2.29.0"))
    assert [t for t in after["targets"] if t != "cpu"] == TARGETS
    assert queue_name("trn3", "2.29.0", "trace") in capability_queues(after)
