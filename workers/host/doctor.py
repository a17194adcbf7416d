"""``compilesvc doctor``: can this host compile for Neuron? A pass/fail report to run first on a new host.

Owns the checks, how each one is run and judged, and the report (text for a bug report, ``--json`` for
machines). Needs no database, broker, store or COMPILESVC_* settings: it runs on a bare compile host before
a worker is configured there. Every compile goes through the worker's own path: the real compile child
(``python -m workers.backends.compile_child``, :mod:`workers.backends.compile_child`) in the environment the
runner gives it
(:func:`workers.isolation.child_env.child_environment`), its
outcome classified by :func:`workers.compiling.classify.classify`, so a FAIL shows the class and code a real compile
would get. Checks, in order:

``toolchain``  neuronx-cc on PATH and its ``--version``; torch and torch-neuronx installed.
``release``    the configured release (``COMPILESVC_NEURON_SDK``) against the installed packages
               (:func:`release_check`, the one place the release-manifest verdict plugs in).
``trace``      the bundled demo model (``compilesvc/demo/tiny-model.pt2``, exported-program) at batch 1,
               seq 16 through the ``trace`` backend (``torch_neuronx.trace``).
``neuronx-cc`` a bundled tiny HLO module (``compilesvc/demo/tiny.hlo.pb``) through the ``neuronx-cc``
               backend (``neuronx-cc compile``, format hlo), whatever the trace did.
``load``       the traced artifact loaded and run once (:mod:`workers.host.load_check`, a process of its own);
               SKIP where there is no Neuron device (``/dev/neuron*``) or the artifact is for another family.

Exit status: 0 every check passed or was skipped; 1 a check failed; 2 bad usage.
"""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import IO, Any

import click

from compilesvc.cli.main import BadInput
from compilesvc.config.settings import Settings
from compilesvc.demo import MODEL_FILE, demo_model_bytes, demo_spec
from compilesvc.hostinfo import host_isa, instance_type
from compilesvc.spec.compile_spec import NEURON_TARGETS
from compilesvc.spec.parsing import parse_spec
from workers.backends.compile_child import RESULT_NAME
from workers.backends.neuron import neuron_devices
from workers.compiling.classify import classify
from workers.host.capabilities import neuron_refusals
from workers.host.capabilities import trace_unavailable as worker_trace_unavailable
from workers.host.doctor_report import FAIL, PASS, SKIP, no_neuron_toolchain, render_text
from workers.host.versions import (
    NEURON_SDK_ENV,
    installed_neuron_packages,
    neuronx_cc_executable,
    python_version,
    torch_version,
)
from workers.isolation.child_env import child_environment
from workers.isolation.compiler_process import CompilerProcess
from workers.isolation.sandbox import Mounts, Policy, Sandbox, sandbox_for

#: Exit status (2, bad usage, is click's UsageError via compilesvc.cli.main).
EXIT_OK, EXIT_FAILED = 0, 1
#: Compiler output lines shown under a FAIL.
TAIL_LINES = 20
#: Seconds one compile may take (a tiny model compiles in well under a minute on a real host).
DEFAULT_TIMEOUT = 1800
#: The HLO module the neuronx-cc check compiles: tanh(x @ w) + 1 as a serialized HloModuleProto, made by
#: examples/tiny-model/make_hlo.py (independent of the trace check, so a broken torch-neuronx does not hide
#: the state of the compiler).
HLO_MODULE = "tiny.hlo.pb"
_TRACE_MODE_RE = re.compile(r"cpu_backend=(True|False) devices=(\d+)")


@dataclass
class Check:
    name: str
    status: str
    detail: str
    seconds: float = 0.0
    error_class: str | None = None
    code: str | None = None
    output_tail: list[str] = field(default_factory=list)


@dataclass
class ChildRun:
    """One subprocess run by a check: how it ended and where its output is."""

    returncode: int
    timed_out: bool
    seconds: float
    log: Path
    tail: list[str]


# -- host facts ---------------------------------------------------------------------------------------------

#: An instance type's family and its variant letters: ``trn1n.32xlarge``, ``trn2n.48xlarge`` (neuron-ls's sample
#: output, aws-neuron-sdk tools/neuron-sys-tools/neuron-ls.rst), ``trn2u.48xlarge`` (neuron-runtime/about/
#: collectives.rst). The SDK's pages name no Trn3 instance type (only UltraServer generations): a ``trn3``
#: prefix with or without letters is taken to be one, unverified against a real host.
_FAMILY_RE = re.compile(r"^([a-z]+[0-9]+)[a-z]*\.")


def host_family(instance: str | None) -> str | None:
    """The Neuron target an instance type is (``inf2.xlarge`` -> inf2; trn1n is a trn1, trn2u a trn2), else
    None."""
    match = _FAMILY_RE.match(instance or "")
    return match.group(1) if match and match.group(1) in NEURON_TARGETS else None


def default_target() -> tuple[str, str]:
    """The target to compile for when none is given, and why."""
    instance = instance_type()
    family = host_family(instance)
    if family:
        return family, f"this host's family (instance type {instance})"
    why = f"instance type {instance} is not a Neuron family" if instance else "instance type unknown"
    return "inf2", f"the default: {why}; choose with --target"


def installed_versions() -> dict[str, str | None]:
    """The Neuron toolchain as installed, by package name (None: not installed)."""
    return {**installed_neuron_packages(), "torch": torch_version()}


def host_facts(target: str, target_source: str) -> dict[str, Any]:
    return {
        "instance_type": instance_type(),
        "neuron_devices": neuron_devices(),
        "target": target,
        "target_source": target_source,
        "python": f"{python_version()} ({sys.executable})",
        "platform": f"{platform.platform()} {host_isa()}",
        "configured_release": os.environ.get(NEURON_SDK_ENV, "").strip() or None,
        "neuronx_cc_path": neuronx_cc_executable(),
        "versions": installed_versions(),
    }


# -- checks that read the host ------------------------------------------------------------------------------

def trace_unavailable(facts: dict[str, Any]) -> str | None:
    """Why a worker here would offer no trace compiles while it serves HLO (None: it offers them): the worker's
    own verdict (:func:`workers.host.capabilities.trace_unavailable`, from the function it registers its kinds
    with), so doctor and worker cannot disagree."""
    why = worker_trace_unavailable(facts["configured_release"])
    return None if why is None else f"{why}: a worker here serves HLO (neuronx-cc) compiles only"


def toolchain_check(facts: dict[str, Any]) -> Check:
    versions = facts["versions"]
    if facts["neuronx_cc_path"] is None:
        return Check("toolchain", FAIL, "neuronx-cc is not on PATH (activate the Neuron environment, or install "
                                        "neuronx-cc from the Neuron package repository)")
    if versions["neuronx-cc"] is None:
        return Check("toolchain", FAIL, f"{facts['neuronx_cc_path']} --version printed no version")
    compiler = f"neuronx-cc {versions['neuronx-cc']} ({facts['neuronx_cc_path']})"
    no_trace = trace_unavailable(facts)
    if no_trace is not None:
        return Check("toolchain", PASS, f"{compiler}; {no_trace}")
    return Check("toolchain", PASS, f"{compiler}, torch-neuronx {versions['torch-neuronx']}, torch {versions['torch']}")


def release_check(release: str | None, installed: dict[str, str | None]) -> Check:
    """The configured release against the installed packages and this environment: the verdict a worker
    gets before it registers (:func:`workers.host.capabilities.neuron_refusals`), so a FAIL here is a worker that
    would refuse to start."""
    if release is None:
        return Check("release", SKIP, f"{NEURON_SDK_ENV} is not set: a worker on this host will offer no Neuron "
                                      f"targets until it names the installed Neuron SDK release (e.g. 2.27.1)")
    problems = neuron_refusals(release, installed, dict(os.environ))
    if problems:
        return Check("release", FAIL, "; ".join(problems))
    return Check("release", PASS, f"{NEURON_SDK_ENV}={release}: the installed packages are that release's, and "
                                  f"no output-changing variable is set")


# -- checks that run the worker's compile path --------------------------------------------------------------

class _FileSink:
    """The child's output into the check's log file (the worker streams it to the ledger instead)."""

    def __init__(self, out: IO[bytes]):
        self.out = out

    def pump(self, stream: IO[bytes]) -> None:
        while chunk := stream.read(1 << 16):
            self.out.write(chunk)


def run_process(argv: list[str], cwd: Path, env: dict[str, str], log: Path, timeout: float,
                sandbox: Sandbox | None = None) -> ChildRun:
    """Run ``argv`` as the runner runs a compile child (:class:`workers.isolation.compiler_process.CompilerProcess`:
    its own process group, killed whole on timeout or on Ctrl-C of the doctor; in ``sandbox`` when given),
    output into ``log``."""
    started = time.monotonic()
    with log.open("wb") as out:
        child = CompilerProcess(argv, cwd=cwd, env=env, logs=_FileSink(out), sandbox=sandbox)
        try:
            returncode, timed_out = child.wait(timeout, threading.Event(), grace=5)
        except BaseException:
            child.signal_group(signal.SIGKILL)
            child.proc.wait()
            raise
    with log.open(errors="replace") as text:
        tail = [line.rstrip("\n") for line in deque(text, maxlen=400)]
    return ChildRun(returncode, timed_out, time.monotonic() - started, log, tail)


def compile_child(name: str, root: Path, request: dict[str, Any], timeout: float) -> tuple[ChildRun, dict[str, Any]]:
    """Run one compile child on ``request`` (work_dir and out_dir are filled in under ``root/name``)."""
    base = root / name
    work_dir, out_dir = base / "work", base / "out"
    work_dir.mkdir(parents=True)
    request = {**request, "work_dir": str(work_dir), "out_dir": str(out_dir), "tp_degree": 1, "isa": None}
    request_path = base / "request.json"
    request_path.write_text(json.dumps(request, indent=1, sort_keys=True))
    out_dir.mkdir()
    env = child_environment(os.environ, request["target"])
    # The worker's own sandbox (COMPILESVC_SANDBOX*), so the check compiles exactly as a worker would; under
    # the pod split (no bubblewrap in this container) the doctor's own, trusted model compiles here directly.
    mounts = Mounts(read_only=[request_path, Path(request["model_path"])], writable=[work_dir, out_dir])
    settings = Settings()
    sandbox = sandbox_for(Policy.from_settings(settings), mounts, env) if settings.sandbox != "pod" else None
    run = run_process([sys.executable, "-m", "workers.backends.compile_child", str(request_path)], work_dir, env,
                      base / "compile.log", timeout, sandbox)
    return run, request


def judged(name: str, run: ChildRun, request: dict[str, Any], success: Callable[[dict[str, Any]], str]) -> Check:
    """The check's verdict from the child's exit, result.json and output, as the runner classifies it."""
    try:
        result = json.loads((Path(request["work_dir"]) / RESULT_NAME).read_text())
    except (OSError, ValueError):
        result = None
    outcome = classify(run.returncode, result, run.tail, run.timed_out, cancelled=False)
    seconds = round(run.seconds, 1)
    if outcome.ok and result is not None:
        return Check(name, PASS, success(result), seconds)
    error_class = str(outcome.error_class or "infra")
    return Check(name, FAIL, f"{error_class} {outcome.code}: {outcome.message}", seconds, error_class,
                 outcome.code, run.tail[-TAIL_LINES:])


def trace_check(root: Path, target: str, sdk: str, flags: list[str], timeout: float) -> tuple[Check, dict[str, Any]]:
    model_dir = root / "trace" / "model"
    model_dir.mkdir(parents=True)
    model = model_dir / MODEL_FILE
    model.write_bytes(demo_model_bytes())
    bucket = parse_spec(demo_spec()).buckets[0]
    inputs = [{"name": i.name, "shape": list(i.shape), "dtype": i.dtype} for i in bucket.inputs]
    request = {"backend": "trace", "target": target, "sdk": sdk, "model_path": str(model),
               "model_format": "exported-program", "inputs": inputs, "args": flags}
    run, request = compile_child("trace", root, request, timeout)
    shapes = ", ".join(f"{i['name']}:{i['dtype']}{i['shape']}" for i in inputs)

    def success(result: dict[str, Any]) -> str:
        files = ", ".join(f"{f['path']} ({f['bytes']} bytes)" for f in result.get("files", []))
        mode = next((m for line in run.tail if (m := _TRACE_MODE_RE.search(line))), None)
        how = (f"; cpu_backend={mode.group(1)} (the compile child saw {mode.group(2)} Neuron devices)"
               if mode else "")
        return f"demo model ({shapes}) traced for {target}: {files}{how}"

    return judged("trace", run, request, success), request


def neuronx_cc_check(root: Path, target: str, sdk: str, flags: list[str], timeout: float) -> Check:
    model_dir = root / "neuronx-cc" / "model"
    model_dir.mkdir(parents=True)
    model = model_dir / "model.hlo.pb"
    model.write_bytes(resources.files("compilesvc.demo").joinpath(HLO_MODULE).read_bytes())
    inputs = [{"name": "x", "shape": [1, 16], "dtype": "float32"}, {"name": "w", "shape": [16, 16], "dtype": "float32"}]
    request = {"backend": "neuronx-cc", "target": target, "sdk": sdk, "model_path": str(model),
               "model_format": "hlo", "inputs": inputs, "args": flags}
    run, request = compile_child("neuronx-cc", root, request, timeout)

    def success(result: dict[str, Any]) -> str:
        files = ", ".join(f"{f['path']} ({f['bytes']} bytes)" for f in result.get("files", []))
        return f"the bundled HLO module (compilesvc/demo/{HLO_MODULE}) compiled for {target}: {files}"

    check = judged("neuronx-cc", run, request, success)
    if check.status == FAIL:
        check.detail += f" (HLO: the bundled compilesvc/demo/{HLO_MODULE})"
    return check


def load_check(root: Path, trace: Check, trace_request: dict[str, Any], devices: list[str],
               facts: dict[str, Any], timeout: float) -> Check:
    target = trace_request["target"]
    family = host_family(facts["instance_type"])
    if not devices:
        return Check("load", SKIP, "no Neuron device on this host (/dev/neuron*): a traced model runs only on a "
                                   "NeuronCore; compiling needs none")
    if trace.status != PASS:
        return Check("load", SKIP, "nothing to load: the trace check did not pass")
    if family is not None and family != target:
        return Check("load", SKIP, f"the artifact is for {target}, this host is {family} (--target {family} to "
                                   f"load here)")
    model = Path(trace_request["out_dir"]) / "model.pt"
    inputs = root / "load" / "inputs.json"
    inputs.parent.mkdir(parents=True)
    inputs.write_text(json.dumps(trace_request["inputs"]))
    run = run_process([sys.executable, "-m", "workers.host.load_check", str(model), str(inputs)], inputs.parent,
                      child_environment(os.environ, target), inputs.parent / "load.log", timeout)
    seconds = round(run.seconds, 1)
    done = next((line.removeprefix("[load-check] ok: ") for line in run.tail if line.startswith("[load-check] ok")),
                None)
    if run.returncode == 0 and done:
        return Check("load", PASS, f"model.pt on {len(devices)} Neuron device(s): {done}", seconds)
    why = "timed out" if run.timed_out else f"exited {run.returncode}"
    last = next((line for line in reversed(run.tail) if line.strip()), "no output")
    return Check("load", FAIL, f"loading or running model.pt {why}: {last}", seconds,
                 output_tail=run.tail[-TAIL_LINES:])


@contextmanager
def work_root(keep: Path | None) -> Iterator[Path]:
    if keep is None:
        with tempfile.TemporaryDirectory(prefix="compilesvc-doctor-") as tmp:
            yield Path(tmp)
        return
    keep.mkdir(parents=True, exist_ok=True)
    yield keep.resolve()


def _progress(message: str) -> None:
    click.echo(f"doctor: {message}", err=True)


@click.command("doctor")
@click.option("--target", type=click.Choice(sorted(NEURON_TARGETS)), default=None,
              help="Neuron target to compile for (default: this host's family from its instance type, else inf2).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON document.")
@click.option("--keep", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Keep the work dirs (requests, compiler logs, artifacts) in DIR, a new or empty directory.")
@click.option("--flag", "flags", multiple=True, metavar="FLAG",
              help="Add a compiler flag to both compiles, as given (repeatable; write --flag=-O1), to see how "
                   "this host's compiler takes a flag your specs use.")
@click.option("--timeout", type=click.IntRange(min=1), default=DEFAULT_TIMEOUT, show_default=True,
              help="Seconds each compile may take.")
def doctor(target: str | None, as_json: bool, keep: Path | None, flags: tuple[str, ...], timeout: int) -> None:
    """Check that this host can compile for Neuron: run it first on a new host, before configuring a worker.

    Reports the host (instance type, Neuron devices, Python, the configured and installed Neuron SDK), traces
    a tiny bundled model with torch-neuronx, compiles a tiny bundled HLO module with neuronx-cc, and loads and runs
    the result where a Neuron device exists; each compile runs the worker's own compile child and is
    classified as the worker would classify it. Needs no database, broker or store.

    Exit status: 0 every check passed or was skipped; 1 a check failed; 2 bad usage.
    """
    if keep is not None and keep.exists() and (not keep.is_dir() or any(keep.iterdir())):
        raise BadInput(f"--keep {keep}: must be a new or empty directory (earlier results would mix with these)")
    target_source = "--target"
    if target is None:
        target, target_source = default_target()
    started = time.monotonic()
    facts = host_facts(target, target_source)
    checks = [toolchain_check(facts)]
    checks[0].seconds = round(time.monotonic() - started, 1)
    checks.append(release_check(facts["configured_release"], facts["versions"]))
    sdk = facts["configured_release"] or "unconfigured"  # the child checks a request's sdk only against the host's
    with work_root(keep) as root:
        if no_neuron_toolchain(facts):
            # Two compiles that can only fail the same way say nothing the toolchain line did not.
            checks += [Check(name, SKIP, "no Neuron toolchain on this host (see toolchain)")
                       for name in ("trace", "neuronx-cc", "load")]
        else:
            no_trace = trace_unavailable(facts)
            if no_trace is None:
                _progress(f"tracing the demo model for {target} (work dir {root})")
                trace, trace_request = trace_check(root, target, sdk, list(flags), timeout)
                checks.append(trace)
            else:
                checks.append(Check("trace", SKIP, no_trace))
            _progress("compiling the bundled HLO module with neuronx-cc")
            checks.append(neuronx_cc_check(root, target, sdk, list(flags), timeout))
            if no_trace is None:
                checks.append(load_check(root, trace, trace_request, facts["neuron_devices"], facts, timeout))
            else:
                checks.append(Check("load", SKIP, "nothing traced to load (see trace)"))
        failed = any(c.status == FAIL for c in checks)
        report: dict[str, Any] = {
            "status": "fail" if failed else "pass", "exit_code": EXIT_FAILED if failed else EXIT_OK,
            "checks": [asdict(c) for c in checks], "host": facts, "work_dir": str(root) if keep is not None else None}
    click.echo(json.dumps(report, indent=2) if as_json else render_text(report))
    click.get_current_context().exit(report["exit_code"])
