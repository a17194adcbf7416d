"""The Neuron backends through the real compile child, against the Neuron SDK TEST DOUBLE.

The double (tests/doubles/neuron) stands in for torch-neuronx / neuronx-cc, which cannot be installed here;
it is put on the child's PYTHONPATH and PATH only. What is tested is our code: the child protocol, how the
compiler is invoked, how its output is streamed and read, and how each outcome is classified.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from compilesvc.config.settings import RANK_COMPILE_MEMORY_BYTES, Settings, default_parallel_rank_compiles
from compilesvc.dispatch.routing import queue_name
from compilesvc.hostinfo import host_memory_bytes
from tests.doubles import NEURON_DOUBLE_DIR, neuron_double_env, with_devices
from tests.doubles.neuron._release import RELEASES
from tests.fixtures.ports import free_port
from tests.fixtures.waiting import wait_for
from tests.workers import DEMO_MODEL, PYTHON, REPO, make_request, run_child, run_children, text_inputs
from workers.backends.neuron_parallel import PARALLEL_MODEL_TRACE_PORT, rendezvous_lock
from workers.compiling.classify import classify
from workers.isolation.child_env import child_environment_for

SDK = "2.27.1"  # the release docker-compose.yml ships
INSTALLED = RELEASES[SDK]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """A device-less host (no /dev/neuron* nodes), with the child environment the runner gives trn1 compiles."""
    return {**neuron_double_env(sdk=SDK, devices=0), **child_environment_for("trn1"),
            "COMPILESVC_NEURON_DEVICE_GLOB": str(tmp_path / "no-devices" / "neuron[0-9]*")}


def _neff_metadata(run: Any) -> dict[str, str]:
    """The double's NEFF records: the compiler's --target and the platform trace lowered for."""
    neff = next((run.work_dir / "neuron").rglob("graph.neff"))
    return dict(line.split("=", 1) for line in neff.read_text().splitlines() if "=" in line)




@pytest.fixture
def hlo(tmp_path: Path) -> Path:
    path = tmp_path / "model.hlo.pb"
    path.write_bytes(b"HloModule fake_for_the_double\n")
    return path


def _trace(tmp_path: Path, name: str, env: dict[str, str], args: list[str], **fields: Any) -> Any:
    fields.setdefault("sdk", SDK)
    return run_child(tmp_path, name, env=env, backend="trace", target="trn1", args=args,
                     inputs=text_inputs(2, 16), **fields)


def _outcome(run: Any) -> Any:
    return classify(run.returncode, run.result, run.lines[-200:], timed_out=False, cancelled=False)


def test_trace_writes_a_loadable_module_and_streams_compiler_logs(tmp_path: Path, env: dict[str, str]) -> None:
    import torch

    env = {**env, "NEURON_CC_FLAGS": "--cache_dir=s3://neuron-cache/cc --verbose=info"}
    run = _trace(tmp_path, "ok", env, ["--auto-cast=none", "--model-type=transformer", "--target=inf2"])
    assert run.returncode == 0, run.describe()
    assert run.result["files"][0]["path"] == "model.pt"
    versions = run.result["versions"]
    assert versions["torch_neuronx"].startswith(INSTALLED.torch_neuronx + "+")
    assert versions["neuronx_cc"] == f"{INSTALLED.neuronx_cc}+{INSTALLED.build_hash}"
    assert versions["neuron_sdk"] == SDK and versions["target"] == "trn1" and versions["torch"] == torch.__version__
    assert versions["trace_lowering"] == "cpu_backend"
    # The wrapper's settings are logged and stay in the environment, never in the compiler args.
    assert "NEURON_CC_FLAGS='--cache_dir=s3://neuron-cache/cc --verbose=info'" in run.stdout
    command = next(line for line in run.lines if "Call compiler with cmd:" in line)
    assert "--target trn1" in command and "--target=inf2" not in command and "s3://" not in command
    assert "--auto-cast=none --model-type=transformer" in command
    # No device on this host: trace lowers on the CPU backend, for the target frozen at the child's start.
    assert "cpu_backend=True devices=0 NEURON_PLATFORM_TARGET_OVERRIDE=trn1" in run.stdout
    assert "platform target frozen at import: trn1; cpu_backend=True" in run.stdout
    assert _neff_metadata(run) == {"target": "trn1", "lowered_for": "trn1", "neuronx_cc": INSTALLED.neuronx_cc,
                                   "lnc": "1"}
    assert "Compiler status PASS" in run.stdout  # the compiler's own output passes through
    assert (run.work_dir / "neuron").is_dir()

    loaded = torch.jit.load(str(run.out_dir / "model.pt"))
    eager = torch.export.load(str(DEMO_MODEL)).module()
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 16, dtype=torch.int64)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, mask), eager(ids, mask), atol=1e-4, rtol=1e-3)


def test_trace_compiler_error_code_is_a_compile_error(tmp_path: Path, env: dict[str, str], scripted: str) -> None:
    run = _trace(tmp_path, "ncc", env, ["--double-behaviour=ncc-error"], model_path=scripted,
                 model_format="torchscript")
    assert run.returncode == 3, run.describe()
    assert run.result["status"] == "compile_error" and run.result["code"] == "NCC_EOOM001"
    assert run.result["message"].startswith("[NCC_EOOM001] The combined memory needed")
    outcome = _outcome(run)
    assert (outcome.error_class, outcome.code, outcome.retryable) == ("compile", "NCC_EOOM001", False)


def test_trace_crash_is_infrastructure_without_a_result(tmp_path: Path, env: dict[str, str], scripted: str) -> None:
    run = _trace(tmp_path, "crash", env, ["--double-behaviour=crash"], model_path=scripted,
                 model_format="torchscript")
    assert run.returncode == -signal.SIGKILL, run.describe()
    assert run.result is None
    outcome = _outcome(run)
    assert (outcome.error_class, outcome.code, outcome.retryable) == ("infra", "SIGKILL", True)
    assert "possibly OOM-killed" in outcome.message


def test_trace_refuses_output_changing_neuron_cc_flags(tmp_path: Path, env: dict[str, str]) -> None:
    env = {**env, "NEURON_CC_FLAGS": "--cache_dir=/var/cache/neuron --auto-cast=all"}
    run = _trace(tmp_path, "flags", env, [])
    assert run.returncode == 4, run.describe()
    assert run.result["code"] == "WORKER_MISCONFIGURED" and "--auto-cast=all" in run.result["message"]
    assert _outcome(run).error_class == "infra"


def _safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (8-byte little-endian length, then the JSON)."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    header.pop("__metadata__", None)
    return dict(header)


def _old_release_host(env: dict[str, str], root: Path, devices: int = 2) -> dict[str, str]:
    """SDK 2.20.0 (neuronx-distributed 0.9: parallel_model_trace) on a host with ``devices`` Neuron devices,
    its rendezvous port moved off 2022 so that other test runs on this host cannot disturb it."""
    old = {**env, **neuron_double_env(sdk="2.20.0", devices=0),
           "COMPILESVC_NEURON_DOUBLE_PMT_PORT": str(free_port())}
    return with_devices(old, root, devices) if devices else old


def test_tp_on_a_current_sdk_goes_through_model_builder(tmp_path: Path, env: dict[str, str],
                                                        scripted: str) -> None:
    """2.27.1 no longer supports parallel_model_trace: ModelBuilder traces once, in the child, with no device."""
    import torch

    run = _trace(tmp_path, "mb", env, ["--auto-cast=none"], tp_degree=2, model_path=scripted,
                 model_format="torchscript")
    assert run.returncode == 0, run.describe()
    assert "through ModelBuilder" in run.stdout and "parallel_model_trace" not in run.stdout
    assert "ModelBuilder tracing model bucket 0 for tp_degree=2 world_size=2 target=trn1" in run.stdout
    assert run.result["versions"]["neuronx_distributed"] == INSTALLED.neuronx_distributed  # the distribution
    assert _neff_metadata(run)["target"] == "trn1"
    files = run.result["files"]
    assert [(f["path"], f["role"], f.get("rank")) for f in files] == [
        ("model.pt", "model", None),
        ("weights/tp0_sharded_checkpoint.safetensors", "weights-shard", 0),
        ("weights/tp1_sharded_checkpoint.safetensors", "weights-shard", 1)]

    # Every rank's weights file carries the model's parameters (the double does not shard: whole tensors).
    eager = torch.jit.load(scripted)
    expected = {name: list(tensor.shape) for name, tensor in eager.state_dict().items()}
    for rank in (0, 1):
        header = _safetensors_header(run.out_dir / "weights" / f"tp{rank}_sharded_checkpoint.safetensors")
        assert {name: entry["shape"] for name, entry in header.items()} == expected
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(7))
    mask = torch.ones(2, 16, dtype=torch.int64)
    with torch.no_grad():
        torch.testing.assert_close(torch.jit.load(str(run.out_dir / "model.pt"))(ids, mask), eager(ids, mask))


def test_tp_passes_a_value_with_spaces_to_model_builder_as_nxdi_does(tmp_path: Path, env: dict[str, str],
                                                                     scripted: str) -> None:
    """ModelBuilder takes the flags as one string: a value with spaces is written --x='v w' (NxDI's own form,
    models/model_wrapper.py) and reaches neuronx-cc whole."""
    args = ["--auto-cast=none", "--tensorizer-options=--enable-ccop-compute-overlap --cc-pipeline-tiling-factor=2",
            "-O2", "--enable-saturate-infinity"]
    run = _trace(tmp_path, "mb-spaced", env, args, tp_degree=2, model_path=scripted, model_format="torchscript")
    assert run.returncode == 0, run.describe()
    flags = next(line for line in run.lines if "Neuron compiler flags:" in line)
    assert " -O2 --enable-saturate-infinity" in flags, flags
    assert "--tensorizer-options='--enable-ccop-compute-overlap --cc-pipeline-tiling-factor=2'" in flags, flags
    # Cut in two, "--cc-pipeline-tiling-factor=2" would be an option neuronx-cc refuses (exit 2).
    options = next(line for line in run.lines if "Compiler options:" in line)
    assert "--tensorizer-options=--enable-ccop-compute-overlap --cc-pipeline-tiling-factor=2 " in options, options


def test_tp_on_an_old_sdk_goes_through_parallel_model_trace_within_the_bound(tmp_path: Path, env: dict[str, str],
                                                                            scripted: str) -> None:
    # SDK 2.20.0 ships neuronx-distributed 0.9.0, before the one-process ModelBuilder; its ranks need a device.
    run = _trace(tmp_path, "pmt", _old_release_host(env, tmp_path), [], tp_degree=2, model_path=scripted,
                 model_format="torchscript", sdk="2.20.0", max_parallel_rank_compiles=1)
    assert run.returncode == 0, run.describe()
    assert "through parallel_model_trace" in run.stdout and "ModelBuilder" not in run.stdout
    files = run.result["files"]
    assert [(f["path"], f["role"], f["rank"]) for f in files] == [("model/tp_0.pt", "model-shard", 0),
                                                                   ("model/tp_1.pt", "model-shard", 1)]
    assert run.result["versions"]["neuronx_distributed"] == "0.9.0"
    # The worker's bound reached the SDK call, and no more ranks than that compiled at once.
    assert "parallel_model_trace tp_degree=2 max_parallel_compilations=1" in run.stdout
    ranks = [line for line in run.lines if "tracing rank" in line]
    assert len(ranks) == 2 and all(line.endswith("(ranks compiling now: 1)") for line in ranks)


@pytest.mark.parametrize(("behaviour", "expected"), [
    ("unsupported-op", ("compile", "UNSUPPORTED_OPERATOR")),  # raised in a rank: unwrapped from spawn's wrapper
    ("oom", ("infra", "COMPILER_KILLED")),
])
def test_a_rank_failure_is_classified_as_the_ranks_own(tmp_path: Path, env: dict[str, str], scripted: str,
                                                        behaviour: str, expected: tuple[str, str]) -> None:
    """parallel_model_trace runs each rank in a torch.multiprocessing.spawn process, which wraps a rank's
    exception in ProcessRaisedException with the rank's traceback as text: classified as the rank's own."""
    host = {**_old_release_host(env, tmp_path), "COMPILESVC_NEURON_DOUBLE_BEHAVIOUR": behaviour}
    run = _trace(tmp_path, behaviour, host, [], tp_degree=2, model_path=scripted, model_format="torchscript",
                 sdk="2.20.0", max_parallel_rank_compiles=1)
    outcome = _outcome(run)
    assert (outcome.error_class, outcome.code) == expected, run.describe()


def test_the_rank_bound_defaults_to_host_memory(tmp_path: Path, env: dict[str, str], scripted: str) -> None:
    """A request without the field (an older runner) gets the setting's default, derived from this host."""
    run = _trace(tmp_path, "pmt-default", _old_release_host(env, tmp_path), [], tp_degree=2, model_path=scripted,
                 model_format="torchscript", sdk="2.20.0")
    assert run.returncode == 0, run.describe()
    expected = min(2, default_parallel_rank_compiles())
    assert f"parallel_model_trace tp_degree=2 max_parallel_compilations={expected}" in run.stdout


def test_parallel_model_trace_without_a_device_is_infrastructure(tmp_path: Path, env: dict[str, str],
                                                                 scripted: str) -> None:
    run = _trace(tmp_path, "pmt-nodev", _old_release_host(env, tmp_path, devices=0), [], tp_degree=2,
                 model_path=scripted, model_format="torchscript", sdk="2.20.0")
    assert run.returncode == 4 and run.result["code"] == "NEURON_DEVICE_REQUIRED", run.describe()
    assert _outcome(run).error_class == "infra"


@pytest.mark.parametrize("sdk", ["2.20.0", SDK], ids=["parallel_model_trace", "model_builder"])
def test_two_tp_compiles_at_once_on_one_host_both_succeed(tmp_path: Path, env: dict[str, str], scripted: str,
                                                          sdk: str) -> None:
    """parallel_model_trace binds one hard-coded port (the double's, for both): the second waits for the first.

    The compiler takes a few seconds (``slow``) while rank 0 holds the port, so the two would overlap."""
    host = _old_release_host(env, tmp_path) if sdk == "2.20.0" else env
    fields = {"backend": "trace", "target": "trn1", "sdk": sdk, "tp_degree": 2, "model_path": scripted,
              "model_format": "torchscript", "inputs": text_inputs(2, 16), "max_parallel_rank_compiles": 2,
              "args": ["--double-behaviour=slow:4"]}
    runs = run_children(tmp_path, [("first", fields), ("second", fields)], env=host)
    for run in runs:
        assert run.returncode == 0, run.describe()
        assert "Address already in use" not in run.stdout + run.stderr
    if sdk == "2.20.0":
        assert all("holding rendezvous port 2022" in run.stdout for run in runs)


def test_a_tp_compile_waits_while_another_holds_the_rendezvous_port(tmp_path: Path, env: dict[str, str],
                                                                    scripted: str) -> None:
    """The lock itself, held by this test: the child says it waits, compiles nothing meanwhile, and goes on
    (and succeeds) once the port is free."""
    path, request = make_request(tmp_path, "waits", backend="trace", target="trn1", sdk="2.20.0", tp_degree=2,
                                 model_path=scripted, model_format="torchscript", max_parallel_rank_compiles=1)
    log = tmp_path / "waits.log"
    with rendezvous_lock(PARALLEL_MODEL_TRACE_PORT), log.open("wb") as out:
        child = subprocess.Popen([sys.executable, "-m", "workers.backends.compile_child", str(path)],
                                 cwd=request["work_dir"],
                                 env=_old_release_host(env, tmp_path), stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: f"waiting for rendezvous port {PARALLEL_MODEL_TRACE_PORT}" in log.read_text()
                     or child.poll() is not None, 120, "the child to wait for the port")
            assert child.poll() is None, log.read_text()
            assert "tracing rank" not in log.read_text()  # nothing compiles while the port is taken
        except BaseException:
            child.kill()
            raise
    assert child.wait(300) == 0, log.read_text()
    text = log.read_text()
    port = PARALLEL_MODEL_TRACE_PORT
    assert text.index(f"waiting for rendezvous port {port}") < text.index(f"holding rendezvous port {port}")


def test_the_rank_bound_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMPILESVC_NEURON_MAX_PARALLEL_RANK_COMPILES", "3")
    assert Settings().neuron_max_parallel_rank_compiles == 3
    monkeypatch.delenv("COMPILESVC_NEURON_MAX_PARALLEL_RANK_COMPILES")
    memory = host_memory_bytes()
    assert memory is not None and memory > 0
    assert Settings().neuron_max_parallel_rank_compiles == max(1, memory // RANK_COMPILE_MEMORY_BYTES)
    monkeypatch.setenv("COMPILESVC_NEURON_MAX_PARALLEL_RANK_COMPILES", "0")
    with pytest.raises(ValueError, match="neuron_max_parallel_rank_compiles"):
        Settings()


def test_trace_on_a_host_with_a_device_does_not_use_the_cpu_backend(tmp_path: Path, env: dict[str, str],
                                                                    scripted: str) -> None:
    run = _trace(tmp_path, "device", with_devices(env, tmp_path, 1), [], model_path=scripted,
                 model_format="torchscript")
    assert run.returncode == 0, run.describe()
    assert "cpu_backend=False devices=1" in run.stdout
    assert "platform target frozen at import: trn1; cpu_backend=False" in run.stdout
    assert _neff_metadata(run)["lowered_for"] == "trn1"
    assert run.result["versions"]["trace_lowering"] == "device"  # the manifest says how it was built


def test_trace_lowers_for_the_requested_target_not_a_stale_override(tmp_path: Path, env: dict[str, str],
                                                                    scripted: str) -> None:
    """The target is frozen when torch_neuronx is imported: the child fixes it first, so inf2 never leaks in."""
    run = _trace(tmp_path, "stale", {**env, "NEURON_PLATFORM_TARGET_OVERRIDE": "inf2"}, [], model_path=scripted,
                 model_format="torchscript")
    assert run.returncode == 0, run.describe()
    assert "platform target frozen at import: trn1" in run.stdout
    assert _neff_metadata(run) == {"target": "trn1", "lowered_for": "trn1", "neuronx_cc": INSTALLED.neuronx_cc,
                                   "lnc": "1"}


def test_the_runner_gives_neuron_children_their_target_from_process_start() -> None:
    assert child_environment_for("trn2") == {"NEURON_PLATFORM_TARGET_OVERRIDE": "trn2"}
    assert child_environment_for("cpu") == {}


def test_trace_on_a_host_with_another_sdk_release_is_infrastructure(tmp_path: Path) -> None:
    run = _trace(tmp_path, "sdk", neuron_double_env(sdk="2.19.0"), [])
    assert run.returncode == 4 and run.result["code"] == "WRONG_SDK", run.describe()


def test_packages_changed_under_a_running_worker_are_infrastructure(tmp_path: Path) -> None:
    """The host claims 2.27.1 but its packages are now 2.26.1's (an upgrade under a running worker): the
    child refuses before compiling rather than publish under 2.27.1's key."""
    run = _trace(tmp_path, "sdk", neuron_double_env(sdk="2.27.1", installed="2.26.1"), [], sdk="2.27.1")
    assert run.returncode == 4 and run.result["code"] == "TOOLCHAIN_MISMATCH", run.describe()
    assert f"neuronx-cc {RELEASES['2.26.1'].neuronx_cc}" in run.result["message"]


# behaviour, child exit code, result status, classified (error_class, code)
HLO_CASES = [
    ("ok", 0, "ok", (None, None)),
    ("ncc-error:NCC_EVRF007", 3, "compile_error", ("compile", "NCC_EVRF007")),
    # neuronx-cc reports an operator it cannot compile with a code (compiler/error-codes/EUOC002.rst).
    ("unsupported-op", 3, "compile_error", ("compile", "NCC_EUOC002")),
    ("exit:70", 6, "unknown_error", ("unknown", "NEURONX_CC_EXIT_70")),  # exit 70 and no code says nothing
    ("exit:1", 6, "unknown_error", ("unknown", "NEURONX_CC_EXIT_1")),
    ("crash", 4, "infra_error", ("infra", "COMPILER_KILLED")),
    ("segfault", 4, "infra_error", ("infra", "COMPILER_KILLED")),
    ("missing-lib", 4, "infra_error", ("infra", "SHARED_LIBRARY")),
]


@pytest.mark.parametrize(("behaviour", "exit_code", "status", "classified"), HLO_CASES,
                         ids=[case[0] for case in HLO_CASES])
def test_neuronx_cc_on_hlo(tmp_path: Path, env: dict[str, str], hlo: Path, behaviour: str, exit_code: int,
                           status: str, classified: tuple[str | None, str | None]) -> None:
    run = run_child(tmp_path, "hlo", env=env, backend="neuronx-cc", target="inf2", sdk=SDK, model_format="hlo",
                    model_path=str(hlo), args=[f"--double-behaviour={behaviour}", "-O2"], tp_degree=8)
    assert run.returncode == exit_code, run.describe()
    assert run.result is not None and run.result["status"] == status
    outcome = _outcome(run)
    assert (outcome.error_class, outcome.code) == classified
    running = next(line for line in run.lines if "[compile-child] running:" in line)
    assert f"compile {hlo} --framework XLA --target inf2 --output {run.out_dir}/model.neff" in running
    if status == "ok":
        assert (run.out_dir / "model.neff").read_bytes().startswith(b"NEFF\0TESTDOUBLE")
        assert run.result["files"][0]["path"] == "model.neff"
        assert run.result["versions"]["neuronx_cc"] == f"{INSTALLED.neuronx_cc}+{INSTALLED.build_hash}"
        assert "Compiler status PASS" in run.stdout
    if behaviour == "crash":
        assert "SIGKILL" in run.result["message"]


def test_the_options_nxdi_passes_reach_neuronx_cc(tmp_path: Path, env: dict[str, str], hlo: Path) -> None:
    """The flags neuronx-distributed-inference passes (models/model_wrapper.py), as a spec gives them, reach
    the compiler as options (in their canonical form, as the runner hands them over), values with spaces whole."""
    from compilesvc.spec.flags import canonical_flags
    from tests.spec.test_compile_spec import NXDI_ARGS

    run = run_child(tmp_path, "nxdi", env=env, backend="neuronx-cc", target="trn2", sdk=SDK, model_format="hlo",
                    model_path=str(hlo), args=canonical_flags(NXDI_ARGS), tp_degree=1)
    assert run.returncode == 0, run.describe()
    options = next(line for line in run.lines if "Compiler options:" in line)
    for given in ("--hbm-scratchpad-page-size=1024", "--layer-unroll-factor=4", "--internal-disable-fma-on-ios",
                  "--internal-bir-enable-sb-allocation", "--internal-enable-dge-levels=spill_reload",
                  "--tensorizer-options=--enable-ccop-compute-overlap --cc-pipeline-tiling-factor=2"):
        assert given in options, options


def test_slow_compiler_streams_lines_and_dies_with_the_process_group(tmp_path: Path, env: dict[str, str],
                                                                    hlo: Path) -> None:
    path, request = make_request(tmp_path, "slow", backend="neuronx-cc", target="trn2", sdk=SDK,
                                 model_format="hlo", model_path=str(hlo), args=["--double-behaviour=slow:30"])
    proc = subprocess.Popen([PYTHON, "-m", "workers.backends.compile_child", str(path)], cwd=request["work_dir"],
                            env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    assert proc.stdout is not None
    started = time.monotonic()
    progress = 0
    for raw in proc.stdout:  # lines arrive while the compiler runs, not when it ends
        if b"progress: pass" in raw:
            progress += 1
            if progress == 3:
                break
    assert progress == 3 and time.monotonic() - started < 20
    os.killpg(proc.pid, signal.SIGKILL)  # what the runner does on timeout/cancel
    assert proc.wait(timeout=10) == -signal.SIGKILL
    # The compiler was in the group: nothing of it keeps running (zombies awaiting a reaper are dead).
    deadline = time.monotonic() + 5
    while _live_group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _live_group_members(proc.pid) == []
    proc.stdout.close()
    assert not (Path(request["work_dir"]) / "result.json").exists()


def _live_group_members(pgid: int) -> list[int]:
    """Pids in process group ``pgid`` that are not zombies (from /proc)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


def _capabilities(env: dict[str, str], hide_torch: bool = False, hide_torch_neuronx: bool = False) -> dict[str, Any]:
    code = ("import json, sys\n"
            + ("sys.modules['torch'] = None\n" if hide_torch else "")
            + ("sys.modules['torch_neuronx'] = None\n" if hide_torch_neuronx else "")
            + "from workers.host.capabilities import detect_capabilities, capability_queues\n"
            "caps = detect_capabilities()\n"
            "caps['queues'] = capability_queues(caps)\n"
            "print(json.dumps(caps))\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_capabilities_with_the_neuron_double(env: dict[str, str]) -> None:
    caps = _capabilities(env)
    assert caps["targets"] == ["cpu", "inf2", "trn1", "trn2"]
    assert caps["sdk"] == {"cpu": "2.13.0", "inf2": SDK, "trn1": SDK, "trn2": SDK}
    assert caps["backends"]["cpu"] == ["aotinductor", "torchscript"]
    assert caps["backends"]["trn1"] == ["neuronx-cc", "nxdi", "trace"]  # the double ships its release's NxDI
    assert caps["versions"]["torch_neuronx"] == f"{INSTALLED.torch_neuronx}+{INSTALLED.build_hash}"
    assert caps["versions"]["neuronx_cc"] == f"{INSTALLED.neuronx_cc}+{INSTALLED.build_hash}"
    assert caps["neuron"]["release"] == SDK
    assert caps["neuron"]["neuronx_cc_path"] == str(NEURON_DOUBLE_DIR / "bin" / "neuronx-cc")
    assert f"compile.cpu.2.13.0.{caps['isa']}" in caps["queues"] and queue_name("trn2", SDK, "trace") in caps["queues"]
    assert {queue_name("trn2", SDK, "neuronx-cc"), queue_name("trn2", SDK, "trace", tp_degree=2)} <= set(caps["queues"])

    narrowed = _capabilities({**env, "COMPILESVC_NEURON_TARGETS": "inf2"})
    assert narrowed["targets"] == ["cpu", "inf2"]


def test_a_host_without_torch_neuronx_serves_only_hlo_queues(env: dict[str, str]) -> None:
    """Each Neuron queue carries one kind of compile (issue 28): neuronx-cc alone serves the HLO ones and
    never a trace queue, whose compiles it could not run."""
    caps = _capabilities(env, hide_torch_neuronx=True)
    assert caps["targets"] == ["cpu", "inf2", "trn1", "trn2"] and caps["backends"]["inf2"] == ["neuronx-cc"]
    neuron = sorted(queue for queue in caps["queues"] if not queue.startswith("compile.cpu."))
    assert neuron and all(queue.endswith((".neuronx-cc", ".neuronx-cc-tp")) for queue in neuron)
    assert any("trace compiles not offered: missing torch_neuronx" in warning for warning in caps["warnings"])


def test_capabilities_without_sdk_release_or_torch() -> None:
    no_release = neuron_double_env(sdk=None)
    no_release.pop("COMPILESVC_NEURON_SDK", None)
    caps = _capabilities(no_release)
    assert caps["targets"] == ["cpu"]
    assert any("COMPILESVC_NEURON_SDK" in warning for warning in caps["warnings"])

    series = _capabilities(neuron_double_env(sdk="2.20"))  # a series, not a release: no queue specs reach
    assert series["targets"] == ["cpu"]
    assert any("'2.20' is not a release" in warning for warning in series["warnings"])

    plain = {k: v for k, v in os.environ.items() if k not in ("COMPILESVC_NEURON_SDK", "PYTHONPATH")}
    caps = _capabilities(plain, hide_torch=True)
    assert caps["targets"] == [] and caps["queues"] == [] and caps["versions"]["torch"] is None
    assert caps["isa"] and "torch is not installed: no cpu target" in caps["warnings"]



def test_the_output_tee_ends_once_drained_though_a_process_keeps_its_pipe_open() -> None:
    """torch's spawn starts multiprocessing's resource tracker, which inherits fds 1 and 2 (the tee's pipes)
    and outlives the compile: EOF never comes. The tee still ends as soon as the pipes are empty, with every
    line written before it ended, instead of waiting out its deadline."""
    from workers.backends.output_tee import DRAIN_SECONDS, OutputTee

    tee = OutputTee()
    tee.__enter__()
    try:
        os.write(1, b"before the lingering process\n")  # fds, not sys.stdout (pytest's capture replaces it)
        lingering = subprocess.Popen(["sleep", "60"])  # inherits the pipes, as the resource tracker does
        os.write(1, b"written at the end\n")
        os.write(2, b"stderr too, without a newline")
    finally:
        started = time.monotonic()
        tee.__exit__(None, None, None)
        ended = time.monotonic() - started
    try:
        assert lingering.poll() is None  # the pipes' write ends were still open when the tee ended
    finally:
        lingering.kill()
        lingering.wait()
    assert ended < DRAIN_SECONDS / 2, ended
    lines = tee.lines
    assert {"before the lingering process", "written at the end", "stderr too, without a newline"} <= set(lines)
