"""bench.stream_memory's comparison with plain S3 (not a bench itself): a model uploaded through the served API
vs boto3's ``upload_file`` of the same file to the same S3 server, and the API processes' peak memory meanwhile.

The API is ``compilesvc serve`` (gunicorn, :func:`tests.fixtures.serve.compilesvc_serve`) with its store on
the S3 server; the upload is ``compilesvc upload FILE`` (the CLI a user runs: it streams the file in POST
/v1/models); the baseline is a fresh interpreter running ``boto3.client("s3").upload_file`` with boto3's
defaults. Both are timed from outside, interpreter start included on both sides, and both write the same
bytes to the same server. Before the upload every process of the server's process group has its peak-RSS
counter reset (``/proc/PID/clear_refs``); afterwards each one's ``VmHWM`` minus its RSS before is its extra
peak, and the figure is their sum (the worker that took the upload holds nearly all of it).

What to expect: the API spools the body to local disk while hashing it (a blob is named by its sha256, and
S3's parallel parts and retries need a seekable source: ``S3Store._put_stream``), and only then uploads, so
its time is about the spool plus an upload like boto3's; the ratio shows what that design costs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from bench._proc import status_kib

ROOT = Path(__file__).resolve().parent.parent

BOTO3_UPLOAD = """
import sys, boto3
boto3.client("s3", endpoint_url=sys.argv[1]).upload_file(sys.argv[2], sys.argv[3], sys.argv[4])
"""


@dataclass(frozen=True)
class Compared:
    api_seconds: float
    boto3_seconds: float
    api_extra_bytes: int  # the sum of the API processes' peak RSS increases during the upload
    processes: int


def _group(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    pids.append(int(entry.name))
            except ProcessLookupError:
                continue
    return pids


def _server_pgid(port: int) -> int:
    """The process group of the ``compilesvc serve`` on ``port`` (the fixture starts it in a session of its own,
    so its group holds the gunicorn master and workers and nothing else)."""
    wanted = ["serve", "--port", str(port)]
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(argv[i:i + 3] == wanted for i in range(len(argv))):
            return os.getpgid(int(entry.name))
    raise RuntimeError(f"no compilesvc serve process on port {port}")


def compare(workdir: Path, source: Path, bucket: str, s3_env: dict[str, str], endpoint: str,
            api_workers: int = 2) -> Compared:
    from tests.fixtures.serve import compilesvc_serve
    from tests.fixtures.tokens import BOOTSTRAP_TOKEN

    prefix = f"served-{uuid.uuid4().hex[:8]}"
    env = {**s3_env, "COMPILESVC_STORE_URL": f"s3://{bucket}/{prefix}", "COMPILESVC_BROKER_URL": "filesystem://",
           "TMPDIR": str(workdir / "spool")}
    with compilesvc_serve(workdir, workers=api_workers, env=env) as served:
        pids = _group(_server_pgid(served.port))
        before = {pid: status_kib("VmRSS", pid) for pid in pids}
        for pid in pids:
            Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS, so the peak read is the upload's
        client_env = {**{k: v for k, v in os.environ.items() if not k.startswith("COMPILESVC_")},
                      "COMPILESVC_TOKEN": BOOTSTRAP_TOKEN, "COMPILESVC_CONFIG": "/nonexistent"}
        started = time.monotonic()
        subprocess.run([sys.executable, "-m", "compilesvc", "upload", str(source), "--api", served.base], cwd=ROOT,
                       env=client_env, check=True, stdout=subprocess.DEVNULL)
        api_seconds = time.monotonic() - started
        extra = sum(max(0, status_kib("VmHWM", pid) - before[pid]) for pid in pids if Path(f"/proc/{pid}").exists())
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", BOTO3_UPLOAD, endpoint, str(source), bucket, f"{prefix}-boto3/model.bin"],
                   env={**os.environ, **s3_env}, check=True)
    boto3_seconds = time.monotonic() - started
    return Compared(api_seconds, boto3_seconds, extra * 1024, len(pids))
