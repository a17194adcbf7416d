"""The Neuron SDK release table (compilesvc/neuron_releases.json) and ``compilesvc neuron-releases``.

The refresh command is run as a real subprocess on a small manifest written here in the SDK's own shape
(aws-neuron-sdk src/helperscripts/n2-manifest.json: ``neuron_releases`` -> ``neuron_version`` + ``packages``
with ``name``/``version``/``supported_instances``); the SDK's file itself is not part of this repository.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from compilesvc.spec import neuron_kinds, neuron_releases, neuron_toolchain
from compilesvc.spec.neuron_releases import UnknownRelease, installed_mismatches, lookup
from compilesvc.spec.neuron_toolchain import toolchain_material
from compilesvc.spec.neuronx_cc_options import OPTIONS, Arity
from tests.cli.test_main import clean_env
from tests.doubles.neuron._release import RELEASES as DOUBLE_RELEASES

CLI = Path(sys.executable).parent / "compilesvc"


def _package(name: str, version: str, instances: tuple[str, ...] = ("trn1", "inf2", "trn2")) -> dict[str, Any]:
    return {"name": name, "version": version, "supported_instances": list(instances),
            "supported_python_versions": ["3.12"]}


def sdk_manifest(*releases: dict[str, Any]) -> dict[str, Any]:
    """A manifest in the SDK's shape (only the parts the refresh reads, plus its header fields)."""
    return {"manifest_date": "01/01/2030", "manifest_version": releases[0]["neuron_version"],
            "neuron_releases": list(releases)}


NEW_RELEASE = {"neuron_version": "2.99.0", "packages": [
    _package("aws-neuronx-runtime-lib", "2.12.23.0", ("inf1",)),  # the inf1 build: another SDK family
    _package("aws-neuronx-runtime-lib", "2.40.1.0"),
    _package("neuronx-cc", "2.30.100.0", ("trn1", "inf2", "trn2", "trn3")),
    _package("torch-neuronx", "2.10.0.2.20.100"),
    _package("torch-neuronx", "2.11.0.2.20.100"),
    _package("neuronx_distributed", "0.22.1"),
    _package("neuronx_distributed_inference", "0.12.1"),  # the manifest's spelling (n2-manifest.json)
    _package("libneuronxla", "3.1.1.0"),
    _package("torch-neuron", "1.13.1.2.11.13.0", ("inf1",)),
]}


def run_cli(tmp_path: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(CLI), *map(str, args)], env=clean_env(tmp_path), cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)


@pytest.fixture
def table_copy(tmp_path: Path) -> Path:
    path = tmp_path / "neuron_releases.json"
    path.write_text(neuron_releases.table_path().read_text())
    return path


def test_the_table_lists_the_releases_the_reference_names() -> None:
    # REFERENCE.md / the SDK manifest: 2.27.1 -> neuronx-cc 2.22.12471.0, torch-neuronx 2.9.0.2.11.19912.
    release = lookup("2.27.1")
    assert release.neuronx_cc == "2.22.12471.0"
    assert release.torch_neuronx == ("2.9.0.2.11.19912", "2.8.0.2.11.19912", "2.7.0.2.11.19912")
    assert release.trace_torch_neuronx == "2.9.0.2.11.19912"
    assert release.neuronx_distributed == "0.16.25997" and release.runtime_lib == "2.29.40.0"
    for label in ("2.19.0", "2.19.1", "2.20.0", "2.24.0", "2.24.1", "2.26.1", "2.27.0", "2.27.1"):
        assert lookup(label).release == label
    assert lookup("2.24.0").neuronx_cc == lookup("2.24.1").neuronx_cc


def test_the_neuron_double_emulates_the_tables_versions() -> None:
    # The double (tests/doubles/neuron/_release.py) and the table come from the same manifest; if they drift,
    # worker-start checks against the double would test a fiction.
    for label, double in DOUBLE_RELEASES.items():
        release = lookup(label)
        assert (double.neuronx_cc, double.torch_neuronx, double.neuronx_distributed, double.runtime) == (
            release.neuronx_cc, release.trace_torch_neuronx, release.neuronx_distributed, release.runtime_lib), label


def test_unknown_release_names_the_refresh_command() -> None:
    with pytest.raises(UnknownRelease, match="compilesvc neuron-releases refresh --from"):
        toolchain_material("2.99.0", "neuronx-cc", 1)


def test_installed_mismatches_name_each_package_that_differs() -> None:
    exact = {"neuronx-cc": "2.22.12471.0+8d1e1a4b", "torch-neuronx": "2.9.0.2.11.19912+8d1e1a4b",
             "neuronx-distributed": "0.16.25997", "libneuronxla": "2.2.14584.0"}
    assert installed_mismatches("2.27.1", exact) == []
    assert installed_mismatches("2.27.0", exact) == []  # same packages: the label is the operator's choice
    problems = installed_mismatches("2.26.1", exact)
    assert "neuronx-cc: installed 2.22.12471.0+8d1e1a4b, release 2.26.1 ships 2.21.33363.0" in problems
    assert any(p.startswith("torch-neuronx: installed 2.9.0.2.11.19912+8d1e1a4b, release 2.26.1 ships "
                            "2.8.0.2.10.16998") for p in problems)
    assert "neuronx-distributed: installed 0.16.25997, release 2.26.1 ships 0.15.22404" in problems
    other_line = installed_mismatches("2.27.1", {**exact, "torch-neuronx": "2.8.0.2.11.19912"})
    assert len(other_line) == 1 and "keys pin its newest torch line" in other_line[0]
    # neuronx-cc alone is a host for HLO compiles (issue 28): torch-neuronx is checked only when installed.
    assert installed_mismatches("2.27.1", {"neuronx-cc": "2.22.12471.0"}) == []
    # 2.32.0 ships no torch-neuronx: a host that has one is not a 2.32.0 host.
    stray = installed_mismatches("2.32.0", {"neuronx-cc": "2.27.5334.0", "torch-neuronx": "2.9.0.2.15.32035"})
    assert stray == ["torch-neuronx: installed 2.9.0.2.15.32035, release 2.32.0 ships nothing"]


def test_refresh_merges_a_new_release_from_the_sdk_manifest(tmp_path: Path, table_copy: Path) -> None:
    source = tmp_path / "n2-manifest.json"
    source.write_text(json.dumps(sdk_manifest(NEW_RELEASE)))
    before = json.loads(table_copy.read_text())
    proc = run_cli(tmp_path, "neuron-releases", "refresh", "--from", source, "--to", table_copy)
    assert proc.returncode == 0, proc.stderr
    assert "added 2.99.0" in proc.stdout and "changed none" in proc.stdout
    after = json.loads(table_copy.read_text())
    assert after["format"] == neuron_releases.TABLE_FORMAT
    assert after["source"]["from"] == str(source) and after["source"]["manifest_version"] == "2.99.0"
    assert after["releases"]["2.99.0"] == {
        "neuronx-cc": "2.30.100.0", "torch-neuronx": ["2.11.0.2.20.100", "2.10.0.2.20.100"],
        "neuronx-distributed": "0.22.1", "neuronx-distributed-inference": "0.12.1", "libneuronxla": ["3.1.1.0"],
        "aws-neuronx-runtime-lib": "2.40.1.0",
        "instances": ["inf2", "trn1", "trn2", "trn3"]}  # neuronx-cc's supported_instances: the release's targets
    # Releases the new file does not list are kept (a published release does not go away).
    assert {k: v for k, v in after["releases"].items() if k != "2.99.0"} == before["releases"]
    assert list(after["releases"])[-1] == "2.99.0"  # ordered by version, not by text


def test_refresh_refuses_a_release_whose_packages_changed(tmp_path: Path, table_copy: Path) -> None:
    changed = {"neuron_version": "2.27.1", "packages": [_package("neuronx-cc", "2.22.99999.0")]}
    source = tmp_path / "n2-manifest.json"
    source.write_text(json.dumps(sdk_manifest(changed)))
    before = table_copy.read_text()
    proc = run_cli(tmp_path, "neuron-releases", "refresh", "--from", source, "--to", table_copy)
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: releases 2.27.1 list other packages") and "--allow-changes" in proc.stderr
    assert table_copy.read_text() == before
    forced = run_cli(tmp_path, "neuron-releases", "refresh", "--from", source, "--to", table_copy, "--allow-changes")
    assert forced.returncode == 0, forced.stderr
    assert json.loads(table_copy.read_text())["releases"]["2.27.1"]["neuronx-cc"] == "2.22.99999.0"


@pytest.mark.parametrize(("content", "fragment"), [
    ("not json", "not JSON"),
    (json.dumps({"releases": []}), 'no "neuron_releases" list'),
    (json.dumps({"neuron_releases": [{"neuron_version": "2.99.0"}]}), "a release entry lacks 'packages'"),
    (json.dumps({"neuron_releases": [{"neuron_version": "2.99.0", "packages": []}]}), "no release that ships"),
])
def test_refresh_refuses_a_file_that_is_not_an_sdk_manifest(tmp_path: Path, table_copy: Path, content: str,
                                                            fragment: str) -> None:
    source = tmp_path / "n2-manifest.json"
    source.write_text(content)
    proc = run_cli(tmp_path, "neuron-releases", "refresh", "--from", source, "--to", table_copy)
    assert proc.returncode == 2 and fragment in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_show_prints_a_release_or_names_the_refresh_command(tmp_path: Path) -> None:
    shown = run_cli(tmp_path, "neuron-releases", "show", "2.27.1")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["neuronx-cc"] == "2.22.12471.0"
    unknown = run_cli(tmp_path, "neuron-releases", "show", "2.99.0")
    assert unknown.returncode == 2 and "neuron-releases refresh" in unknown.stderr


def test_the_neuron_double_accepts_every_option_a_compile_passes_on() -> None:
    """Canonical flags (what the worker hands the compiler) keep only output-changing options, by their
    names: the double's neuronx-cc must accept each of them that its releases have, with the same arity, or
    tests would see a rejected flag where the SDK compiles."""
    import importlib.machinery
    import importlib.util

    path = Path(__file__).parents[1] / "doubles" / "neuron" / "bin" / "neuronx-cc"
    loader = importlib.machinery.SourceFileLoader("neuronx_cc_double", str(path))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    double = importlib.util.module_from_spec(spec)
    loader.exec_module(double)
    arity = {Arity.SWITCH: 0, Arity.ONE: 1, Arity.SEVERAL: "+"}
    for release in DOUBLE_RELEASES:
        passed_on = [o for o in OPTIONS if o.changes_output and o.reserved is None and o.available(release)
                     and not o.name.startswith("--internal-")]
        missing = [o.name for o in passed_on if o.name not in double.OPTIONS]
        assert missing == [], (release, missing)
        assert [o.name for o in passed_on if double.OPTIONS[o.name][0] != arity.get(o.arity)] == [], release


def test_trace_needs_a_device_before_2_21_and_releases_sharing_a_queue_agree() -> None:
    """cpu_backend first appears in the SDK 2.21.0 trace API reference (aws-neuron-sdk commit 752349fd); before
    it a device-less host cannot trace (aws-neuron-sdk#910). Releases whose compiles share a queue
    (toolchain_release) must agree, or a device-less worker of one would consume the other's compiles."""
    assert "need a host with a Neuron device" in (neuron_kinds.device_requirement("2.20.2", "trace", 1) or "")
    assert "trace tp > 1" in (neuron_kinds.device_requirement("2.19.0", "trace", 2) or "")
    assert neuron_kinds.device_requirement("2.21.0", "trace", 1) is None
    assert neuron_kinds.device_requirement("2.19.0", "neuronx-cc", 1) is None  # HLO needs no device
    for release in neuron_releases.table():
        for tp_degree in (1, 2):
            if neuron_kinds.compile_kind("trace", tp_degree) not in neuron_kinds.release_kinds(release):
                continue
            shared = neuron_toolchain.toolchain_release(release, "trace", tp_degree)
            assert (neuron_kinds.device_requirement(release, "trace", tp_degree) is None) == (
                neuron_kinds.device_requirement(shared, "trace", tp_degree) is None), (release, shared)
