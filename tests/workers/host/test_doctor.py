"""``compilesvc doctor`` as a real process, against the Neuron SDK TEST DOUBLE (tests/doubles/neuron).

The doctor runs the real compile child and load check, so what is tested is its whole path: host facts,
the worker's child environment, classification, the bundled HLO module it compiles, the report and the exit
status. The double cannot be installed, so it is on the doctor's PYTHONPATH and PATH
(:func:`tests.doubles.neuron_double_env`); the compile children get the environment the runner gives them,
which drops the double's own ``COMPILESVC_NEURON_DOUBLE_*`` switches, so a misbehaviour is chosen with the
double's compiler flag (``--flag=--double-behaviour=...``), as the worker-path tests do.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.doubles import NEURON_DOUBLE_DIR, neuron_double_env, with_devices
from tests.doubles.neuron._release import RELEASES

SDK = "2.27.1"
INSTALLED = RELEASES[SDK]
CLI = Path(sys.executable).with_name("compilesvc")
CHECK_LINE_RE = re.compile(r"^(PASS|FAIL|SKIP)  (\S+)\s+(.*)  \[(\d+\.\d) s\]$")


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """A device-less host with the Neuron double installed and SDK 2.27.1 configured, no other settings."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("COMPILESVC_")}
    env = neuron_double_env(base, sdk=SDK, devices=0)
    env["COMPILESVC_NEURON_DEVICE_GLOB"] = str(tmp_path / "no-devices" / "neuron[0-9]*")
    return env


def doctor(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(CLI), "doctor", *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def checks_of(report: str) -> dict[str, tuple[str, str]]:
    """name -> (status, detail) from the text report's check lines."""
    found = {}
    for line in report.splitlines():
        match = CHECK_LINE_RE.match(line)
        if match:
            found[match.group(2)] = (match.group(1), match.group(3))
    return found


def test_a_device_less_host_compiles_through_trace_and_neuronx_cc_and_skips_the_load(
        env: dict[str, str], tmp_path: Path) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    run = doctor({**env, "TMPDIR": str(scratch)}, tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("compilesvc doctor: PASS\n")
    checks = checks_of(run.stdout)
    assert list(checks) == ["toolchain", "release", "trace", "neuronx-cc", "load"]
    assert checks["toolchain"][0] == "PASS" and f"neuronx-cc {INSTALLED.neuronx_cc}+" in checks["toolchain"][1]
    assert checks["release"] == ("PASS", f"COMPILESVC_NEURON_SDK={SDK}: the installed packages are that release's, "
                                         f"and no output-changing variable is set")
    status, detail = checks["trace"]
    assert status == "PASS" and "traced for inf2: model.pt (" in detail and "cpu_backend=True" in detail
    status, detail = checks["neuronx-cc"]
    assert status == "PASS", detail
    assert re.search(r"the bundled HLO module \(compilesvc/demo/tiny\.hlo\.pb\) compiled for inf2: "
                     r"model\.neff \(\d+ bytes\)", detail)
    assert checks["load"][0] == "SKIP" and "no Neuron device" in checks["load"][1]
    host = run.stdout.split("\nhost:\n", 1)[1]
    assert "  neuron devices      none" in host
    assert "  target              inf2 (the default: " in host  # this test host has no EC2 instance type
    assert f"  configured release  {SDK}" in host
    assert f"neuronx-distributed {INSTALLED.neuronx_distributed}" in host
    # Without --keep the work dirs go: the progress lines named one under TMPDIR, and it is gone.
    assert "work dirs" not in run.stdout
    assert f"(work dir {scratch}/compilesvc-doctor-" in run.stderr and not any(scratch.glob("compilesvc-doctor-*"))


def test_a_host_with_a_device_loads_and_runs_the_traced_model_and_json_parses(
        env: dict[str, str], tmp_path: Path) -> None:
    keep = tmp_path / "kept"
    run = doctor(with_devices(env, tmp_path, 2), tmp_path, "--json", "--keep", str(keep), "--target", "trn1")
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout)
    assert report["status"] == "pass" and report["exit_code"] == 0
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    assert statuses == {"toolchain": "PASS", "release": "PASS", "trace": "PASS", "neuronx-cc": "PASS",
                        "load": "PASS"}
    load = next(c for c in report["checks"] if c["name"] == "load")
    assert load["detail"].startswith("model.pt on 2 Neuron device(s): loaded in ")
    assert "output float32[1, 4]" in load["detail"]  # the demo classifier's logits for batch 1
    host = report["host"]
    assert [Path(p).name for p in host["neuron_devices"]] == ["neuron0", "neuron1"]
    assert host["target"] == "trn1" and host["target_source"] == "--target"
    assert host["versions"]["torch-neuronx"].startswith(INSTALLED.torch_neuronx)
    # --keep leaves every step's request, log and output behind.
    assert report["work_dir"] == str(keep.resolve())
    assert json.loads((keep / "trace" / "request.json").read_text())["target"] == "trn1"
    assert (keep / "trace" / "out" / "model.pt").is_file() and (keep / "neuronx-cc" / "out" / "model.neff").is_file()
    assert "[load-check] ok" in (keep / "load" / "load.log").read_text()


def test_a_compile_error_fails_with_its_class_code_and_the_compiler_output(env: dict[str, str],
                                                                           tmp_path: Path) -> None:
    run = doctor(env, tmp_path, "--flag=--double-behaviour=ncc-error:NCC_EVRF007")
    assert run.returncode == 1, run.stdout + run.stderr
    assert run.stdout.startswith("compilesvc doctor: FAIL (2 of 5 checks failed)\n")
    checks = checks_of(run.stdout)
    for name in ("trace", "neuronx-cc"):
        status, detail = checks[name]
        assert status == "FAIL" and detail.startswith("compile NCC_EVRF007: "), detail
    assert checks["load"][0] == "SKIP"
    sections = run.stdout.split("\nFAIL trace: class compile, code NCC_EVRF007\n", 1)
    assert len(sections) == 2, run.stdout
    tail = sections[1].split("\nFAIL neuronx-cc: ", 1)[0].splitlines()
    assert tail[0].startswith("  last ") and tail[0].endswith(" lines of its output:")
    assert 2 <= len(tail) - 1 <= 20
    assert any("[NCC_EVRF007]" in line for line in tail)  # the compiler's own line, as it printed it
    assert "run again with --keep DIR" in run.stdout


def test_a_broken_torch_neuronx_fails_the_trace_but_not_the_compiler_check(env: dict[str, str],
                                                                          tmp_path: Path) -> None:
    """The neuronx-cc check compiles its own bundled HLO module: a trace that cannot even import
    torch-neuronx does not hide whether the compiler works."""
    shadow = tmp_path / "shadow" / "torch_neuronx"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        'raise ImportError("libneuronxla.so: cannot open shared object file: No such file or directory")\n')
    broken = {**env, "PYTHONPATH": f"{shadow.parent}{os.pathsep}{env['PYTHONPATH']}"}
    run = doctor(broken, tmp_path, "--json")
    assert run.returncode == 1, run.stdout + run.stderr
    checks = {c["name"]: c for c in json.loads(run.stdout)["checks"]}
    assert checks["trace"]["status"] == "FAIL" and checks["trace"]["error_class"] == "infra", checks["trace"]
    assert checks["neuronx-cc"]["status"] == "PASS", checks["neuronx-cc"]
    assert "the bundled HLO module (compilesvc/demo/tiny.hlo.pb)" in checks["neuronx-cc"]["detail"]
    assert checks["load"]["status"] == "SKIP"


@pytest.mark.parametrize(("sdk", "without", "why"), [
    ("2.32.0", (), "Neuron SDK 2.32.0 ships no torch-neuronx"),
    (SDK, ("torch_neuronx",), "torch-neuronx not installed"),
    # Issue 28 (3): no cpu_backend before 2.21.0 (aws-neuron-sdk commit 752349fd), no trace without a device.
    ("2.19.0", (), "compiles of Neuron SDK 2.19.0 need a host with a Neuron device"),
])
def test_a_host_that_serves_hlo_only_passes_and_says_why_it_traces_nothing(
        sdk: str, without: tuple[str, ...], why: str, tmp_path: Path) -> None:
    """Issue 28: a 2.32.0 host (neuronx-cc, no torch-neuronx: the SDK's own manifest) and a host without
    torch-neuronx serve HLO compiles (workers.host.versions); doctor says so and compiles the HLO module."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("COMPILESVC_")}
    env = neuron_double_env(base, sdk=sdk, devices=0, without=without)
    env["COMPILESVC_NEURON_DEVICE_GLOB"] = str(tmp_path / "no-devices" / "neuron[0-9]*")
    run = doctor(env, tmp_path, "--json")
    assert run.returncode == 0, run.stdout + run.stderr
    checks = {c["name"]: c for c in json.loads(run.stdout)["checks"]}
    assert checks["toolchain"]["status"] == "PASS" and why in checks["toolchain"]["detail"], checks["toolchain"]
    assert "serves HLO (neuronx-cc) compiles only" in checks["toolchain"]["detail"]
    assert (checks["trace"]["status"], checks["load"]["status"]) == ("SKIP", "SKIP")
    assert checks["neuronx-cc"]["status"] == "PASS" and checks["release"]["status"] == "PASS", checks


def test_packages_of_another_release_fail_the_release_check_as_a_worker_would_refuse(
        env: dict[str, str], tmp_path: Path) -> None:
    """The host claims 2.27.1 but has 2.26.1's packages, and sets an output-changing variable: the worker
    would refuse to start, and the doctor says why, naming each package and the variable."""
    claimed = {**neuron_double_env(env, sdk=SDK, installed="2.26.1", devices=0), "XLA_USE_BF16": "1"}
    run = doctor(claimed, tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    status, detail = checks_of(run.stdout)["release"]
    assert status == "FAIL"
    assert f"neuronx-cc: installed {RELEASES['2.26.1'].neuronx_cc}" in detail
    assert f"release {SDK} ships {INSTALLED.neuronx_cc}" in detail
    assert "XLA_USE_BF16" in detail


def test_no_neuronx_cc_on_path_is_a_clear_failure(env: dict[str, str], tmp_path: Path) -> None:
    double_bin = str(NEURON_DOUBLE_DIR / "bin")
    path = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != double_bin)
    unconfigured = {k: v for k, v in env.items() if k != "COMPILESVC_NEURON_SDK"}
    run = doctor({**unconfigured, "PATH": path}, tmp_path, "--json")
    assert run.returncode == 1, run.stdout + run.stderr
    report: dict[str, Any] = json.loads(run.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert report["status"] == "fail" and report["host"]["neuronx_cc_path"] is None
    assert checks["toolchain"]["status"] == "FAIL"
    assert checks["toolchain"]["detail"].startswith("neuronx-cc is not on PATH")
    assert checks["release"]["status"] == "SKIP"
    assert checks["release"]["detail"].startswith("COMPILESVC_NEURON_SDK is not set: a worker on this host will offer "
                                                  "no Neuron targets")
    compile_check = checks["neuronx-cc"]
    assert (compile_check["status"], compile_check["error_class"], compile_check["code"]) == (
        "FAIL", "infra", "NEURONX_CC_MISSING")


def test_a_host_without_any_neuron_toolchain_says_so_in_a_few_lines(tmp_path: Path) -> None:
    # Seen: on a cpu host, a wall of FAIL/SKIP, two compiles that could only fail, and "class -, code -".
    plain = {k: v for k, v in os.environ.items() if not k.startswith("COMPILESVC_") and k != "PYTHONPATH"}
    plain["COMPILESVC_NEURON_DEVICE_GLOB"] = str(tmp_path / "no-devices" / "neuron[0-9]*")
    run = doctor(plain, tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "This host has no Neuron toolchain (neither neuronx-cc nor torch-neuronx)" in run.stdout
    assert "A worker here serves the cpu target (torch " in run.stdout and "docs/neuron-hosts.md" in run.stdout
    checks = checks_of(run.stdout)
    assert checks["toolchain"][0] == "FAIL"
    assert {checks[name][0] for name in ("trace", "neuronx-cc", "load")} == {"SKIP"}
    assert "class -" not in run.stdout and "--keep DIR" not in run.stdout
    assert "tracing" not in run.stderr  # no compile was started


def test_bad_usage_exits_2_with_one_error_line(env: dict[str, str], tmp_path: Path) -> None:
    wrong_target = doctor(env, tmp_path, "--target", "cpu")
    assert wrong_target.returncode == 2 and wrong_target.stdout == ""
    assert wrong_target.stderr.startswith("error: ") and "'cpu' is not one of" in wrong_target.stderr
    used = tmp_path / "used"
    used.mkdir()
    (used / "old.log").write_text("an earlier run")
    not_empty = doctor(env, tmp_path, "--keep", str(used))
    assert not_empty.returncode == 2 and not_empty.stdout == ""
    assert not_empty.stderr == f"error: --keep {used}: must be a new or empty directory (earlier results would " \
                               f"mix with these)\n"


def test_help_documents_the_exit_status(env: dict[str, str], tmp_path: Path) -> None:
    run = doctor(env, tmp_path, "--help")
    assert run.returncode == 0
    text = " ".join(run.stdout.split())
    assert "Exit status: 0 every check passed or was skipped; 1 a check failed; 2 bad usage." in text


@pytest.mark.parametrize(("instance", "family"), [
    ("inf2.xlarge", "inf2"), ("trn1n.32xlarge", "trn1"), ("trn2n.48xlarge", "trn2"),  # neuron-ls's sample output
    ("trn2u.48xlarge", "trn2"),  # neuron-runtime/about/collectives.rst
    ("trn3.48xlarge", "trn3"),  # no Trn3 instance type is named in the SDK's pages: the family prefix decides
    ("inf1.xlarge", None), ("m7i.4xlarge", None), (None, None),
])
def test_the_default_target_is_the_instance_familys(instance: str | None, family: str | None) -> None:
    from workers.host.doctor import host_family

    assert host_family(instance) == family
