"""The egress proof: the compile's network reaches none of the service's own endpoints (the canaries).

A compile runs the model, so it must not reach the API, the ledger, the broker or the store (docs/security.md,
"Compile isolation"). Whatever is meant to stop it (bubblewrap's network namespace, the pod's NetworkPolicy,
a namespace the runner makes), this module checks it from where the compile runs: a TCP connect to each
configured canary (``COMPILESVC_EGRESS_CANARIES``, comma-separated ``host:port``) with a short timeout.

- **Reached**: the connect succeeded. The compile could talk to that endpoint: refuse (exit 78, EX_CONFIG),
  unless the operator set ``COMPILESVC_EGRESS_ACKNOWLEDGED=1`` (then every compile logs it loudly).
- **Unreachable**: refused, timed out, no route, or the name does not resolve.

Names are resolved by the caller, in its own network (the worker's or the runner's), and the addresses are
probed from the compile's: a sandbox that cannot resolve names proves nothing about the addresses, which a
compile could dial directly. :func:`probe_command` (``python -I -c`` :data:`PROBE_SOURCE`, the standard library
only) probes the given addresses and prints what it reached as JSON: how a caller probes from inside a
sandbox (bubblewrap's argv, the runner's ``unshare`` prefix). The connects run in parallel, so one probe
costs about one timeout at most.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.isolation.sandbox import Mounts, Policy, Sandbox

EX_CONFIG = 78
CANARIES_ENV = "COMPILESVC_EGRESS_CANARIES"
ACKNOWLEDGED_ENV = "COMPILESVC_EGRESS_ACKNOWLEDGED"
#: Seconds per connect: a policy that drops packets costs one timeout per probe (they run in parallel).
CONNECT_TIMEOUT_SECONDS = 1.0
#: What a refused compile's message tells the operator to do.
FIX = ("give the compile no route to the service: in pod mode a deny-all egress NetworkPolicy for the compile's "
       "traffic (docs/deploy.md, 'Compile isolation'), in bwrap mode bubblewrap's own network namespace; or, if "
       f"you accept this, set {ACKNOWLEDGED_ENV}=1")


@dataclass(frozen=True)
class Target:
    """One address to try: ``label`` is the canary as configured (``host:port``)."""

    label: str
    address: str
    port: int


def parse_canaries(text: str) -> list[tuple[str, int]]:
    """``host:port,host:port`` (``[v6]:port`` too) as pairs; raise ValueError naming a malformed entry."""
    canaries = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        host, sep, port = entry.rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{CANARIES_ENV}: {entry!r} is not host:port")
        canaries.append((host, int(port)))
    return canaries


def resolve(canaries: Sequence[tuple[str, int]]) -> list[Target]:
    """Each canary's addresses as this process's network resolves them; a name that does not resolve has
    none (unreachable by name, and nothing to dial)."""
    targets = []
    for host, port in canaries:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            continue
        for address in dict.fromkeys(str(info[4][0]) for info in infos):
            targets.append(Target(f"{host}:{port}", address, port))
    return targets


#: The probe itself, standard library only, so that it runs wherever the compile's interpreter runs (inside
#: bubblewrap, whose binds need not include this package: ``python -I -c``): the targets as JSON in argv[1],
#: the timeout in argv[2]; prints the reached labels as JSON. This module runs the same code in-process.
PROBE_SOURCE = """
import json, socket, sys
from concurrent.futures import ThreadPoolExecutor

def connects(address, port, timeout):
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return True
    except OSError:  # refused, unreachable, timed out
        return False

def reached(targets, timeout):
    if not targets:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(targets))) as pool:  # one timeout at most, not one each
        hits = list(pool.map(lambda t: connects(t[1], t[2], timeout), targets))
    return sorted({t[0] for t, hit in zip(targets, hits) if hit})

if __name__ == "__main__":
    print(json.dumps(reached(json.loads(sys.argv[1]), float(sys.argv[2]))), flush=True)
"""
_PROBE: dict[str, Any] = {"__name__": "workers.isolation.egress.probe"}
exec(compile(PROBE_SOURCE, "<egress probe>", "exec"), _PROBE)  # a constant: the same code in both places


def _payload(targets: Sequence[Target]) -> list[list[str | int]]:
    return [[t.label, t.address, t.port] for t in targets]


def reached(targets: Sequence[Target], timeout: float = CONNECT_TIMEOUT_SECONDS) -> list[str]:
    """The canaries (labels, each once, sorted) of which this process's network reached an address."""
    return list(_PROBE["reached"](_payload(targets), timeout))


def probe_command(targets: Sequence[Target], python: str = sys.executable,
                  timeout: float = CONNECT_TIMEOUT_SECONDS) -> list[str]:
    """The command that probes ``targets`` from wherever it runs (prefix it with a sandbox's argv)."""
    return [python, "-I", "-c", PROBE_SOURCE, json.dumps(_payload(targets)), str(timeout)]


def reached_from(prefix: Sequence[str], targets: Sequence[Target], *, env: Mapping[str, str] | None = None,
                 cwd: str | None = None, timeout: float = 60.0) -> list[str]:
    """:func:`reached`, from the network of the process ``prefix`` starts (``[]``: this process's). A probe
    that fails to run raises RuntimeError: no proof is not a pass."""
    if not prefix:
        return reached(targets)
    run = subprocess.run([*prefix, *probe_command(targets)], env=None if env is None else dict(env), cwd=cwd,
                         capture_output=True, text=True, timeout=timeout, check=False)
    try:
        answer = json.loads(run.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        answer = None
    if run.returncode != 0 or not isinstance(answer, list):
        why = (run.stderr.strip().splitlines() or [f"exit {run.returncode}"])[-1]
        raise RuntimeError(f"the egress probe did not run in the compile's network ({why})")
    return sorted(str(label) for label in answer)


def refusal(reached_labels: Sequence[str]) -> str:
    """The one-line refusal naming what the compile's network reached, and the fix."""
    return (f"the compile's network reached {', '.join(reached_labels)} "
            f"({CANARIES_ENV}); {FIX}")


def acknowledged(environ: Mapping[str, str]) -> bool:
    """Whether the operator accepted that compiles may reach the canaries."""
    return environ.get(ACKNOWLEDGED_ENV, "").strip().lower() in {"1", "true", "yes"}


def configured_targets(environ: Mapping[str, str]) -> list[Target]:
    """The configured canaries, resolved here."""
    return resolve(parse_canaries(environ.get(CANARIES_ENV, "")))


def sandbox_refusal(policy: Policy, env: Mapping[str, str], scratch: Path,
                    environ: Mapping[str, str]) -> str | None:
    """bwrap mode: the proof from inside the sandbox a compile gets (the same bubblewrap argv, its own network
    namespace), the canaries of ``environ`` resolved in the worker's network. None: nothing reached (or
    acknowledged, which the caller logs); else the refusal."""
    targets = configured_targets(environ)
    sandbox = Sandbox(policy, Mounts(writable=[scratch]), env)
    sandbox.hand_over()
    try:
        got = reached_from(sandbox.argv([], scratch), targets, env=sandbox.environment(scratch),
                           cwd=str(sandbox.process_cwd(scratch)))
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if got and not acknowledged(environ):
        return refusal(got)
    return None
