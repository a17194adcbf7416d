"""The key cannot lie about the toolchain: worker-start checks, the child's environment, manifest versions.

Against the Neuron SDK TEST DOUBLE (tests/doubles/neuron), which reports the exact package versions of the
release named by ``COMPILESVC_NEURON_DOUBLE_RELEASE`` (``neuron_double_env(installed=...)``) while the worker
claims ``COMPILESVC_NEURON_SDK`` (``sdk=...``). Worker starts are real ``compilesvc worker`` processes; a
refused start never reaches the ledger or the broker, so none is needed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from compilesvc.spec.neuron_releases import lookup
from tests.cli.test_main import clean_env
from tests.doubles import neuron_double_env
from tests.doubles.neuron._release import RELEASES
from tests.workers import REPO, run_child, text_inputs
from workers.isolation.child_env import child_environment, child_environment_for

CLI = Path(sys.executable).parent / "compilesvc"
EX_CONFIG = 78


def start_worker(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # No broker or database is reachable: a worker that got past its checks would fail differently (and
    # later), so the exit status tells the refusal apart.
    env = {**env, "COMPILESVC_DATABASE_URL": "postgresql+psycopg://nobody@127.0.0.1:1/none",
           "COMPILESVC_BROKER_URL": "redis://127.0.0.1:1/0"}
    return subprocess.run([str(CLI), "worker", "-c", "1"], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)


def host(tmp_path: Path, **double: Any) -> dict[str, str]:
    return neuron_double_env(clean_env(tmp_path), devices=0, **double)


def capabilities(env: dict[str, str]) -> dict[str, Any]:
    code = ("import json\nfrom workers.host.capabilities import detect_capabilities\n"
            "print(json.dumps(detect_capabilities()))\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    caps: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    return caps


def error_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_a_worker_whose_packages_are_another_release_refuses_to_start(tmp_path: Path) -> None:
    proc = start_worker(tmp_path, host(tmp_path, sdk="2.27.1", installed="2.26.1"))
    assert proc.returncode == EX_CONFIG, proc.stderr
    line = error_line(proc)
    installed, claimed = RELEASES["2.26.1"], lookup("2.27.1")
    assert (f"neuronx-cc: installed {installed.neuronx_cc}+{installed.build_hash}, release 2.27.1 ships "
            f"{claimed.neuronx_cc}") in line
    assert f"torch-neuronx: installed {installed.torch_neuronx}+{installed.build_hash}" in line
    assert f"neuronx-distributed: installed {installed.neuronx_distributed}, release 2.27.1 ships " \
           f"{claimed.neuronx_distributed}" in line


def test_a_neuronx_cc_on_path_that_is_not_the_package_trace_imports_refuses_to_start(tmp_path: Path) -> None:
    """The HLO backend runs the executable on PATH, trace the neuronxcc package: a key names one version."""
    env = host(tmp_path, sdk="2.27.1")
    stray = tmp_path / "stray-bin"
    stray.mkdir()
    (stray / "neuronx-cc").write_text("#!/bin/sh\necho 'NeuronX Compiler version 2.21.33363.0+0e3e7b17'\n")
    (stray / "neuronx-cc").chmod(0o755)
    env["PATH"] = f"{stray}:{env['PATH']}"
    proc = start_worker(tmp_path, env)
    assert proc.returncode == EX_CONFIG, proc.stderr
    line = error_line(proc)
    assert f"the executable on PATH ({stray / 'neuronx-cc'}) is 2.21.33363.0+0e3e7b17" in line
    assert f"the neuronxcc package trace imports is {RELEASES['2.27.1'].neuronx_cc}" in line


def test_a_release_the_table_does_not_know_refuses_to_start_with_the_refresh_command(tmp_path: Path) -> None:
    proc = start_worker(tmp_path, host(tmp_path, sdk="2.99.0", installed="2.27.1"))
    assert proc.returncode == EX_CONFIG, proc.stderr
    line = error_line(proc)
    assert "COMPILESVC_NEURON_SDK=2.99.0" in line and "compilesvc neuron-releases refresh --from" in line


@pytest.mark.parametrize(("variable", "value", "where"), [
    ("NEURON_LOGICAL_NC_CONFIG", "2", "--lnc N"),
    ("XLA_USE_BF16", "1", "--auto-cast all --auto-cast-type bf16"),
    ("XLA_DOWNCAST_BF16", "1", "--auto-cast all --auto-cast-type bf16"),
    ("NEURON_CC_FLAGS", "--cache_dir=/var/cache/neuron --auto-cast all", "compiler.args"),
])
def test_output_changing_environment_refuses_to_start(tmp_path: Path, variable: str, value: str,
                                                      where: str) -> None:
    proc = start_worker(tmp_path, {**host(tmp_path, sdk="2.27.1"), variable: value})
    assert proc.returncode == EX_CONFIG, proc.stderr
    line = error_line(proc)
    assert variable in line and where in line


def test_matching_packages_register_neuron_targets_and_releases_sharing_them_are_equal(tmp_path: Path) -> None:
    # 2.31.0 and 2.31.1 ship identical packages (release manifest): either claim is true of a 2.31.1 install.
    for claim in ("2.31.1", "2.31.0"):
        caps = capabilities({**host(tmp_path, sdk=claim, installed="2.31.1"),
                             "NEURON_CC_FLAGS": "--cache_dir=/var/cache/neuron --verbose 35"})
        assert caps["neuron"]["refused"] == [], caps["warnings"]
        assert {"inf2", "trn1", "trn2", "trn3"} <= set(caps["targets"]) and caps["sdk"]["trn2"] == claim
        assert caps["neuron"]["release_packages"]["neuronx-cc"] == "2.26.6360.0"
        assert caps["neuron"]["packages"]["neuronx-distributed"] == RELEASES["2.31.1"].neuronx_distributed


def test_a_release_differing_only_in_nxdi_is_another_release(tmp_path: Path) -> None:
    # 2.27.0 and 2.27.1 ship the same compiler, torch-neuronx and NxD but not the same NxD Inference (0.7.14366,
    # 0.7.15063: the release manifest): a 2.27.1 install is not 2.27.0, and says which package differs.
    caps = capabilities(host(tmp_path, sdk="2.27.0", installed="2.27.1"))
    assert any("neuronx-distributed-inference: installed 0.7.15063, release 2.27.0 ships 0.7.14366" in line
               for line in caps["neuron"]["refused"]), caps["neuron"]["refused"]


def test_a_refused_host_offers_no_neuron_target_to_library_callers(tmp_path: Path) -> None:
    caps = capabilities(host(tmp_path, sdk="2.27.1", installed="2.20.0"))
    assert not {"inf2", "trn1", "trn2"} & set(caps["targets"])
    assert caps["neuron"]["refused"] and all(any(p in w for w in caps["warnings"]) for p in caps["neuron"]["refused"])


def test_the_child_environment_is_an_allow_list(tmp_path: Path) -> None:
    worker_env = {
        **neuron_double_env(clean_env(tmp_path), sdk="2.27.1"),
        "LC_ALL": "C.UTF-8", "NEURON_RT_VISIBLE_CORES": "0-1", "NEURON_RT_LOG_LEVEL": "INFO",
        "NEURON_CC_FLAGS": "--cache_dir=/var/cache/neuron",
        # dropped: output-changing (the worker refuses these at start; the child never sees them either way)
        "NEURON_LOGICAL_NC_CONFIG": "2", "XLA_USE_BF16": "1", "XLA_FLAGS": "--xla_dump_to=/tmp/x",
        "TORCHINDUCTOR_MAX_AUTOTUNE": "1", "NEURON_PLATFORM_TARGET_OVERRIDE": "inf2", "NEURON_FUSE_SOFTMAX": "1",
        # dropped: the service's settings and secrets
        "COMPILESVC_DATABASE_URL": "postgresql://u:p@db/x", "AWS_SECRET_ACCESS_KEY": "s", "AWS_REGION": "us-east-1",
        "NEURON_RT_AUTH_TOKEN": "t",
    }
    env = {**child_environment(worker_env), **child_environment_for("trn2")}  # what the runner starts it with
    proc = subprocess.run([sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    for kept in ("PATH", "PYTHONPATH", "LC_ALL", "NEURON_RT_VISIBLE_CORES", "NEURON_RT_LOG_LEVEL", "NEURON_CC_FLAGS",
                 "COMPILESVC_NEURON_SDK", "COMPILESVC_NEURON_DOUBLE_RELEASE"):
        assert seen[kept] == worker_env[kept], kept
    for gone in ("NEURON_LOGICAL_NC_CONFIG", "XLA_USE_BF16", "XLA_FLAGS", "TORCHINDUCTOR_MAX_AUTOTUNE",
                 "NEURON_FUSE_SOFTMAX", "COMPILESVC_DATABASE_URL", "AWS_SECRET_ACCESS_KEY", "AWS_REGION",
                 "NEURON_RT_AUTH_TOKEN"):
        assert gone not in seen, gone
    assert seen["NEURON_PLATFORM_TARGET_OVERRIDE"] == "trn2"  # the request's, not the worker's
    assert seen["PYTHONUNBUFFERED"] == "1"
    # Whatever the interpreter adds by itself aside, nothing else passed.
    assert set(seen) - set(env) <= {"LC_CTYPE"}


def test_manifest_versions_name_the_exact_toolchain_and_the_releases_runtime(tmp_path: Path) -> None:
    env = {**neuron_double_env(sdk="2.27.1", devices=0), **child_environment_for("trn1"),
           "COMPILESVC_NEURON_DEVICE_GLOB": str(tmp_path / "no-devices" / "neuron[0-9]*")}
    installed = RELEASES["2.27.1"]
    trace = run_child(tmp_path, "trace", env=env, backend="trace", target="trn1", sdk="2.27.1", args=[],
                      inputs=text_inputs(1, 8))
    assert trace.returncode == 0, trace.describe()
    versions = trace.result["versions"]
    assert versions["neuronx_cc"] == f"{installed.neuronx_cc}+{installed.build_hash}"
    assert versions["torch_neuronx"] == f"{installed.torch_neuronx}+{installed.build_hash}"
    assert versions["neuronx_distributed"] == installed.neuronx_distributed
    assert versions["neuron_sdk"] == "2.27.1" and versions["aws_neuronx_runtime_lib"] == "2.29.40.0"

    hlo = tmp_path / "model.hlo.pb"
    hlo.write_bytes(b"HloModule fake_for_the_double\n")
    env = {**env, **child_environment_for("inf2")}
    compiled = run_child(tmp_path, "hlo", env=env, backend="neuronx-cc", target="inf2", sdk="2.27.1",
                         model_format="hlo", model_path=str(hlo), args=["-O2"])
    assert compiled.returncode == 0, compiled.describe()
    assert compiled.result["versions"]["neuronx_cc"] == f"{installed.neuronx_cc}+{installed.build_hash}"
    assert compiled.result["versions"]["aws_neuronx_runtime_lib"] == "2.29.40.0"
    assert compiled.result["versions"]["neuron_sdk"] == "2.27.1"


def test_a_2_33_worker_registers_with_trace_and_hlo_but_no_nxdi(tmp_path: Path) -> None:
    # SDK 2.33.0/2.33.1 (from the SDK's pages, not the manifest: compilesvc/spec/neuron_releases.json
    # "from_docs"): neuronx-cc 2.28.7631.0 and torch-neuronx 2.9.0.2.15.32035 again, no NxD. Before issue 41 the
    # table stopped at 2.32.0 and this host exited 78.
    for claim in ("2.33.0", "2.33.1"):
        caps = capabilities(host(tmp_path, sdk=claim, installed="2.33.0"))
        assert caps["neuron"]["refused"] == [], caps["warnings"]
        assert {"inf2", "trn1", "trn2", "trn3"} <= set(caps["targets"]) and caps["sdk"]["trn3"] == claim
        assert caps["neuron"]["release_packages"]["neuronx-cc"] == "2.28.7631.0"
        assert caps["neuron"]["packages"]["torch-neuronx"].startswith("2.9.0.2.15.32035")
    # A 2.32.0 install claiming 2.33.0 is refused, naming the compiler.
    caps = capabilities(host(tmp_path, sdk="2.33.0", installed="2.32.0"))
    assert any("neuronx-cc: installed 2.27.5334.0" in line and "2.33.0 ships 2.28.7631.0" in line
               for line in caps["neuron"]["refused"]), caps["neuron"]["refused"]
