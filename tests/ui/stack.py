"""A real service for the browser suite and the README's screenshots: ``compilesvc dev --demo`` (API,
worker and relay processes on SQLite, a local artifact directory and the filesystem broker, the real
TorchScript compiler), then a handful of real builds a person would want to look at: a miss caused by one
changed flag, a partly reused set, a hit, a compile error and a build that joined it, and a build for a
target no worker here serves (it stays queued).

Also finds Chromium for Playwright: Playwright cannot download its own browser here, so the suite drives
Debian's ``chromium`` (installed by ``.ci/test-tools`` where missing).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from compilesvc.demo import demo_model_bytes, demo_spec
from tests.fixtures.ports import free_port

COMPILESVC = str(Path(sys.executable).with_name("compilesvc"))
CHROMIUM_ARGS = ["--no-sandbox", "--disable-background-networking"]


def find_chromium() -> str | None:
    """Debian's Chromium (or the one ``COMPILESVC_CHROMIUM`` names), or None."""
    named = os.environ.get("COMPILESVC_CHROMIUM")
    if named:
        return named if Path(named).is_file() else None
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


@dataclass
class UiStack:
    """The running service and its admin token; ``builds`` names the seeded builds by what they show."""

    base: str
    token: str
    data_dir: Path
    proc: subprocess.Popen[bytes]
    builds: dict[str, int] = field(default_factory=dict)

    def call(self, method: str, path: str, body: Any = None, *, token: str | None = None,
             data: bytes | None = None, expect: tuple[int, ...] = (200, 201, 202)) -> Any:
        headers = {"Authorization": f"Bearer {token or self.token}"}
        if data is not None:
            headers["Content-Type"] = "application/octet-stream"
        response = requests.request(method, self.base + path, json=body, data=data, headers=headers, timeout=30)
        assert response.status_code in expect, f"{method} {path}: {response.status_code} {response.text[:500]}"
        return response.json()

    def submit(self, spec: dict[str, Any], *, queue_anyway: bool = False) -> int:
        path = "/v1/builds?queue_anyway=true" if queue_anyway else "/v1/builds"
        return int(self.call("POST", path, spec)["build_id"])

    def wait(self, build_id: int, timeout: float = 180) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            build: dict[str, Any] = self.call("GET", f"/v1/builds/{build_id}")
            if build["state"] != "building":
                return build
            time.sleep(0.3)
        raise AssertionError(f"build {build_id} still building after {timeout} s; logs in {self.data_dir}/logs")

    def token_for(self, *scopes: str, owner: str, team: str | None = None) -> str:
        made = self.call("POST", "/v1/tokens", {"name": f"ui-{owner}", "owner": owner, "team": team or owner,
                                                 "scopes": list(scopes)})
        return str(made["token"])

    def demo_spec(self, **changes: Any) -> dict[str, Any]:
        """The bundled demo's spec (its model uploaded: content-addressed, so the same URI every time)."""
        spec = demo_spec()
        spec["model"]["uri"] = self.call("POST", "/v1/models", data=demo_model_bytes())["uri"]
        spec.update(changes)
        return spec


@contextmanager
def running_stack(data_dir: Path, *, timeout: float = 300) -> Iterator[UiStack]:
    """``compilesvc dev --demo`` on a free port until the demo build succeeded; stopped (SIGTERM to its
    process group, which stops its children) on leaving."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPILESVC_", "AWS_", "TORCHINDUCTOR_"))}
    log_path = data_dir.parent / f"{data_dir.name}-dev.out"
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([COMPILESVC, "dev", "--demo", "--port", str(port), "--data-dir", str(data_dir)],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while "Ctrl-C stops it." not in log_path.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"compilesvc dev did not come up: {log_path.read_text(errors='replace')[-3000:]}")
            time.sleep(0.3)
        token = (data_dir / "admin-token").read_text().strip()
        stack = UiStack(base=f"http://127.0.0.1:{port}", token=token, data_dir=data_dir, proc=proc)
        stack.builds["demo"] = 1
        yield stack
    finally:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def seed(stack: UiStack) -> dict[str, int]:
    """Real builds worth looking at, compiled by the stack's worker; returns their ids by name."""
    demo = stack.demo_spec()
    # One flag changed (the demo freezes its TorchScript module; this one does not): a miss to explain.
    unfrozen = stack.demo_spec(compiler={"backend": "torchscript", "args": []},
                               labels={"team": "search", "pipeline": "ci-1042"})
    stack.builds["miss"] = stack.submit(unfrozen)
    stack.wait(stack.builds["miss"])
    # The same set plus one bucket: three reused, one compiled.
    bigger = stack.demo_spec(compiler={"backend": "torchscript", "args": []},
                             buckets=[*unfrozen["buckets"], {"batch_size": 16, "seq_len": 64}],
                             labels={"team": "search", "pipeline": "ci-1043"})
    stack.builds["partly"] = stack.submit(bigger)
    stack.wait(stack.builds["partly"])
    stack.builds["hit"] = stack.submit(demo)
    # float32 ids where the model embeds integers: the compiler (torch.jit.trace) refuses the model.
    broken = stack.demo_spec(buckets=[{"inputs": [{"name": "input_ids", "shape": [2, 16], "dtype": "float32"}]}],
                             labels={"team": "ranking"})
    stack.builds["failed"] = stack.submit(broken)
    stack.wait(stack.builds["failed"])
    stack.builds["joined_failure"] = stack.submit(broken)
    # For inf2, which no worker here compiles: queued until cancelled (the workers page warns about it).
    stack.builds["unserved"] = stack.submit(stack.demo_spec(target="inf2", sdk="2.20.0", compiler={}),
                                            queue_anyway=True)
    return stack.builds
