"""Peak-memory benchmark of the artifact stores: put_file, put_stream and download_blob of a 1 GiB blob.

Run from the repository root: ``python -m bench.stream_memory [--size-mib 1024] [--limit-mb 100]``.

It starts a real S3 server (``weed mini``, as the tests do), writes a random file, and measures each
operation on LocalStore and S3Store in a fresh child process: the child builds the store, records its
RSS, resets the kernel's peak-RSS counter (``/proc/self/clear_refs``), runs the one operation and reads
``VmHWM``. The difference is the operation's extra peak memory, unmixed with imports or other runs.

Then the same file is uploaded the way a user does, ``compilesvc upload`` to a served API (``compilesvc
serve``) whose store is that S3 server, against boto3's ``upload_file`` of the file to the same server
(:mod:`bench._served_upload`): the time ratio (target: at most :data:`UPLOAD_RATIO_TARGET`, the streaming
hash and the API hop costing under a third of a raw upload) and the API processes' extra peak RSS during
the upload (target: under ``--limit-mb``). ``--no-served`` skips it.

Every figure also goes to the one table (:mod:`bench._table`). Exit status 1 if any operation needs more
than the limit or a target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._proc import status_kib
from bench._table import record

MB = 1000 * 1000
UPLOAD_RATIO_TARGET = 1.3  # compilesvc upload through the served API / boto3 upload_file, wall time
OPERATIONS = ("put_file", "put_stream", "download_blob")


# -- child: one measurement ---------------------------------------------------------------------------


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    from compilesvc.config.settings import Settings
    from compilesvc.store import open_store

    settings = Settings(
        data_dir=Path(args.workdir) / "data",
        store_url=args.store_url,
        s3_endpoint_url=args.endpoint,
        secret_key="bench-secret",
    )
    store = open_store(settings)
    source = Path(args.file)

    baseline = status_kib("VmRSS")
    # "5" resets VmHWM to the current RSS (Linux >= 4.0), so the peak we read is this operation's alone.
    Path("/proc/self/clear_refs").write_text("5")
    started = time.perf_counter()
    if args.op == "put_file":
        info = store.put_file(source)
        result = {"sha256": info.sha256, "created": info.created}
    elif args.op == "put_stream":
        with open(source, "rb") as stream:
            info = store.put_stream(stream, max_bytes=source.stat().st_size)
        result = {"sha256": info.sha256, "created": info.created}
    else:
        dest = Path(args.workdir) / "downloaded.bin"
        store.download_blob(args.sha256, dest)
        result = {"sha256": args.sha256, "created": False}
        dest.unlink()
    seconds = time.perf_counter() - started
    peak = status_kib("VmHWM")
    return {**result, "seconds": seconds, "baseline_kib": baseline, "extra_bytes": (peak - baseline) * 1024}


# -- parent: orchestration ----------------------------------------------------------------------------


def _child(
    op: str, store_url: str, workdir: Path, source: Path, endpoint: str, env: dict[str, str], sha256: str = ""
) -> dict[str, Any]:
    command = [
        sys.executable,
        "-m",
        "bench.stream_memory",
        "--measure",
        op,
        "--store-url",
        store_url,
        "--workdir",
        str(workdir),
        "--file",
        str(source),
        "--endpoint",
        endpoint,
        "--sha256",
        sha256,
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{op} on {store_url} failed:\n{done.stderr}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _write_random_file(path: Path, size: int) -> None:
    chunk = 16 * 1024 * 1024
    with open(path, "wb") as out:
        remaining = size
        while remaining:
            n = min(chunk, remaining)
            out.write(os.urandom(n))
            remaining -= n


def _served(workdir: Path, source: Path, bucket: str, server: Any, size: int, limit: float,
            args: argparse.Namespace) -> bool:
    from bench._served_upload import compare

    print(f"\nuploading the {args.size_mib} MiB file with compilesvc upload to compilesvc serve (S3 store) and with "
          f"boto3 upload_file to the same S3 server ...", flush=True)
    found = compare(workdir, source, bucket, server.env(), server.endpoint_url)
    ratio = found.api_seconds / found.boto3_seconds
    print(f"compilesvc upload via the API {found.api_seconds:.1f} s ({size / MB / found.api_seconds:.0f} MB/s), "
          f"boto3 upload_file {found.boto3_seconds:.1f} s ({size / MB / found.boto3_seconds:.0f} MB/s): "
          f"{ratio:.2f}x (target <= {UPLOAD_RATIO_TARGET}); the API's {found.processes} processes' extra peak RSS "
          f"{found.api_extra_bytes / MB:.1f} MB (target < {limit / MB:g} MB)")
    timed = record("stream_memory", f"{args.size_mib} MiB upload: compilesvc upload via the API / boto3 upload_file",
                   ratio, "x", at_most=UPLOAD_RATIO_TARGET, vs="boto3 upload_file to the same S3 server",
                   note=f"{found.api_seconds:.1f} s vs {found.boto3_seconds:.1f} s")
    memory = record("stream_memory", f"{args.size_mib} MiB upload: the API processes' extra peak RSS",
                    found.api_extra_bytes / MB, "MB", at_most=limit / MB,
                    vs="their RSS before the upload (VmHWM reset)",
                    note=f"sum over the {found.processes} processes of compilesvc serve")
    return timed.met is not False and memory.met is not False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--limit-mb", type=float, default=100.0)
    parser.add_argument("--no-served", action="store_true",
                        help="skip the upload through compilesvc serve vs boto3 upload_file")
    parser.add_argument("--workdir", help="scratch directory (default: a new temp dir, removed afterwards)")
    parser.add_argument("--measure", choices=OPERATIONS, help=argparse.SUPPRESS)
    parser.add_argument("--store-url", help=argparse.SUPPRESS)
    parser.add_argument("--file", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--sha256", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.measure:
        args.op = args.measure
        print(json.dumps(_measure(args)))
        return 0

    from tests.fixtures.s3server import start_weed, stop_weed

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="stream-memory-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    proc = None
    try:
        print(f"starting weed mini and writing a {args.size_mib} MiB random file under {workdir} ...", flush=True)
        proc, server = start_weed(workdir / "weed")
        bucket = server.new_bucket("bench")
        source = workdir / "model.bin"
        _write_random_file(source, args.size_mib * 1024 * 1024)
        spool = workdir / "spool"
        spool.mkdir(exist_ok=True)
        env = {
            **os.environ,
            **server.env(),
            "TMPDIR": str(spool),
            "AWS_CONFIG_FILE": "/nonexistent",
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
        }
        env.pop("AWS_PROFILE", None)

        rows: list[tuple[str, str, dict[str, Any]]] = []
        for kind in ("local", "s3"):

            def url(name: str, kind: str = kind) -> str:
                return (workdir / f"local-{name}").as_uri() if kind == "local" else f"s3://{bucket}/{name}"

            put_file = _child("put_file", url("a"), workdir, source, server.endpoint_url, env)
            rows.append((kind, "put_file", put_file))
            # A second, empty store: put_stream must really upload, not find the blob already there.
            rows.append((kind, "put_stream", _child("put_stream", url("b"), workdir, source, server.endpoint_url, env)))
            rows.append(
                (
                    kind,
                    "download_blob",
                    _child("download_blob", url("a"), workdir, source, server.endpoint_url, env, put_file["sha256"]),
                )
            )
            if kind == "local":
                shutil.rmtree(workdir / "local-a")
                shutil.rmtree(workdir / "local-b")

        size = args.size_mib * 1024 * 1024
        limit = args.limit_mb * MB
        print(f"\npeak RSS increase per operation, {args.size_mib} MiB blob, limit < {args.limit_mb:g} MB extra")
        print(f"{'store':<6} {'operation':<14} {'seconds':>8} {'MB/s':>8} {'extra peak RSS':>15}  result")
        failed = False
        for kind, op, row in rows:
            ok = row["extra_bytes"] < limit and row["sha256"] == rows[0][2]["sha256"]
            failed |= not ok
            record("stream_memory", f"{kind} {op}: extra peak RSS, {args.size_mib} MiB", row["extra_bytes"] / MB,
                   "MB", at_most=args.limit_mb, vs="the process's RSS just before the operation",
                   note=f"{size / MB / row['seconds']:.0f} MB/s" + ("" if row["sha256"] == rows[0][2]["sha256"]
                                                                   else "; sha256 MISMATCH"))
            print(
                f"{kind:<6} {op:<14} {row['seconds']:>8.1f} {size / MB / row['seconds']:>8.0f} "
                f"{row['extra_bytes'] / MB:>12.1f} MB  {'PASS' if ok else 'FAIL'}"
            )
        if not args.no_served:
            failed |= not _served(workdir, source, bucket, server, size, limit, args)
        print(f"\nsha256 {rows[0][2]['sha256']}; overall: {'FAIL' if failed else 'PASS'}")
        return 1 if failed else 0
    finally:
        if proc is not None:
            stop_weed(proc)
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
