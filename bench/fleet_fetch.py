"""What a fleet's boot costs with ``compilesvc fetch``, against what it would cost without it, in one run.

Run from the repository root: ``python -m bench.fleet_fetch [--size-mib 256] [--rounds 3]``.

A real S3 server (``weed mini``) holds an artifact of two buckets (``--size-mib`` in all); the API (the
real app, SQLite ledger, in this process) hands out its manifest. Each figure is the median of
``--rounds``, printed beside its baseline from the same run:

* cold fetch (parallel download, sha256 while streaming, fsync, atomic install) vs what a boot script does
  without it: ``curl`` each presigned URL, then ``sha256sum`` the files (target: at most 1.2x);
* warm fetch (every byte re-hashed from the cache, no network) vs ``sha256sum`` of the same files (target:
  at most 1.5x: the rest is the Python process and the manifest check);
* 8 processes booting at once into one empty cache vs 8 each into its own (what a shared volume would see
  without the cache's per-file locks; target: no slower, with an eighth of the bytes on the network);
* a lookup of a key nobody built (404) vs a lookup of a published one (target: at most 1.5x);
* **the lookup vs the S3 server itself**: GET /v1/artifacts/{key} through the production server
  (``compilesvc serve``, gunicorn with ``--api-workers`` processes, on the same ledger and S3 store) vs a
  presigned GET of the same artifact's manifest object straight from ``weed``, which is what a fleet would do
  without the service (a URL handed out by hand, nothing checked). Both under the same load: ``wrk``
  (``--lookup-seconds`` each, ``--lookup-connections`` connections), time per request compared. Target: at
  most 1.5x. Why 1.5x: the lookup reads the same manifest (cached) and adds what the bare GET does not have:
  authorizing the token against the ledger and presigning a URL per file; at 1.5x the service costs a fleet
  half of one small S3 GET per boot, against downloads of hundreds of MiB.

Every figure also goes to the one table (:mod:`bench._table`). Exit status 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._fetch_compare import compare_row, curl_and_sha256sum, median_seconds  # noqa: E402
from bench._proc import children, cpu_of_each  # noqa: E402
from bench._table import record  # noqa: E402  (after the path, so it runs from anywhere)
from bench._wrk import run_wrk  # noqa: E402
from compilesvc.store.base import artifact_manifest_name  # noqa: E402


def _row(name: str, value: float, baseline_name: str, baseline: float, target: float) -> bool:
    return compare_row("fleet_fetch", name, value, baseline_name, baseline, target)


def lookup_vs_presigned(workdir: Path, args: argparse.Namespace, s3: Any, database: str, key: str, token: str,
                        manifest_location: str) -> bool:
    """GET /v1/artifacts/{key} on ``compilesvc serve`` vs a presigned GET of the manifest from the S3 server."""
    from tests.fixtures.serve import compilesvc_serve

    bucket, _, object_key = manifest_location.removeprefix("s3://").partition("/")
    presigned = s3.client().generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": object_key},
                                                   ExpiresIn=3600)
    env = {**s3.env(), "COMPILESVC_DATABASE_URL": database, "COMPILESVC_STORE_URL": f"s3://{bucket}/artifacts",
           "COMPILESVC_BROKER_URL": "filesystem://"}
    load = {"seconds": args.lookup_seconds, "connections": args.lookup_connections}
    extra = ["--reuse-port"] if args.reuse_port else []
    with compilesvc_serve(workdir, extra_args=extra, workers=args.api_workers, env=env) as served:
        answer = urllib.request.urlopen(urllib.request.Request(f"{served.base}/v1/artifacts/{key}",
                                                               headers={"Authorization": f"Bearer {token}"}))
        assert answer.status == 200, answer.status
        # Each API worker's CPU during the load: wrk's few long-lived connections go to whichever worker
        # accepts them, and a worker that stalls meanwhile gets none (the other then serves alone, on one
        # core: the 4.0x run, before web/server/httpworker.py closed connections off its event loop). The split is
        # printed beside the figure, so such a run reads as what it is.
        workers = children(served.pid)
        before = cpu_of_each(workers)
        lookup = run_wrk(f"{served.base}/v1/artifacts/{key}", headers={"Authorization": f"Bearer {token}"}, **load)
        split = " / ".join(f"{after - then:.1f}" for after, then in zip(cpu_of_each(workers), before, strict=True))
    with urllib.request.urlopen(presigned) as direct:
        assert direct.status == 200, direct.status
    bare = run_wrk(presigned, **load)
    ratio = lookup.seconds_per_request / bare.seconds_per_request
    ok = ratio <= 1.5 and lookup.errors == 0 and bare.errors == 0
    print(f"{'lookup, compilesvc serve':<34} {lookup.rps:9.0f} /s   {'presigned GET of the manifest':<34} "
          f"{bare.rps:9.0f} /s   ratio {ratio:5.2f} (target <= 1.50) {'ok' if ok else 'MISSED'}; p50/p99 "
          f"{lookup.p50}/{lookup.p99} vs {bare.p50}/{bare.p99}; errors {lookup.errors} and {bare.errors}; "
          f"API workers' CPU seconds {split}", flush=True)
    record("fleet_fetch", "artifact lookup (compilesvc serve) / presigned GET of its manifest, time per request",
           ratio, "x", at_most=1.5, vs="the manifest object GET straight from the S3 server (weed), presigned",
           note=f"{lookup.rps:.0f} vs {bare.rps:.0f} requests/s, {args.lookup_connections} connections each; "
                f"{args.api_workers} API processes{' with --reuse-port' if args.reuse_port else ''} "
                f"(CPU s each: {split})" + (f"; errors {lookup.errors}/{bare.errors}"
                                                       if lookup.errors or bare.errors else ""))
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet_fetch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lookup-seconds", type=float, default=10, help="wrk's duration for each side")
    parser.add_argument("--lookup-connections", type=int, default=8)
    parser.add_argument("--api-workers", type=int, default=2, help="gunicorn processes of the served API")
    parser.add_argument("--reuse-port", action="store_true",
                        help="serve the lookup with `compilesvc serve --reuse-port` (a socket per worker)")
    args = parser.parse_args(argv)

    import logging

    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request would bury the table

    from compilesvc.ledger.migrate import upgrade
    from compilesvc.services import Services
    from tests.fixtures.s3server import start_weed, stop_weed
    from tests.fixtures.settings import make_settings
    from tests.fixtures.signing import trust_env
    from tests.fixtures.tokens import make_token
    from tests.web.support import complete_build, spec_for
    from web.server.app import create_app

    workdir = Path(tempfile.mkdtemp(prefix="fleet-fetch-"))
    proc = None
    services = None
    try:
        print(f"starting weed mini; publishing a {args.size_mib} MiB artifact (2 buckets) ...", flush=True)
        proc, s3 = start_weed(workdir / "weed")
        os.environ.update(s3.env())
        bucket = s3.new_bucket("fleet")
        database = f"sqlite:///{workdir / 'ledger.db'}"
        upgrade(database)
        listener = socket.create_server(("127.0.0.1", 0))
        base = f"http://127.0.0.1:{listener.getsockname()[1]}"
        services = Services.from_settings(make_settings(workdir / "api", database, public_url=base,
                                                        store_url=f"s3://{bucket}/artifacts",
                                                        s3_endpoint_url=s3.endpoint_url,
                                                        require_live_worker=False))
        app = create_app(services=services)
        server = make_server("127.0.0.1", 0, app, threaded=True, fd=listener.fileno())
        threading.Thread(target=server.serve_forever, daemon=True).start()
        admin = make_token(services.sessions, "admin", owner="bench")
        fleet = make_token(services.sessions, "fleet", owner="fleet")
        client = app.test_client()
        client.environ_base["HTTP_AUTHORIZATION"] = f"Bearer {admin}"
        uri = client.post("/v1/models", data=b"bench model", content_type="application/octet-stream").json["uri"]
        build = client.post("/v1/builds", json=spec_for(uri, buckets=((1, 8), (2, 8)))).json
        half = args.size_mib * 1024 * 1024 // 2
        complete_build(services, build["build_id"], payload=lambda key: random.Random(key).randbytes(half))
        key = build["artifact_key"]
        env = {**os.environ, "COMPILESVC_TOKEN": fleet, "COMPILESVC_API_URL": base,
               "COMPILESVC_CONFIG": "/nonexistent", **trust_env(services)}  # fetches verify the signature too
        fetch = [sys.executable, "-m", "compilesvc", "fetch", key, "-q"]

        def fresh_cache() -> str:
            path = workdir / "cache"
            shutil.rmtree(path, ignore_errors=True)
            return str(path)

        def cold() -> None:
            subprocess.run(fetch, env={**env, "COMPILESVC_CACHE_DIR": fresh_cache()}, check=True,
                           stdout=subprocess.DEVNULL)

        def curl_and_sha256sum_all() -> None:
            curl_and_sha256sum(client.get(f"/v1/artifacts/{key}").json, workdir / "curl")

        results = [_row("cold fetch (verified, installed)", median_seconds(cold, args.rounds), "curl + sha256sum",
                        median_seconds(curl_and_sha256sum_all, args.rounds), 1.2)]

        cache = fresh_cache()
        subprocess.run(fetch, env={**env, "COMPILESVC_CACHE_DIR": cache}, check=True, stdout=subprocess.DEVNULL)
        files = [p for p in (Path(cache) / "v1" / "artifacts" / key).rglob("*") if p.is_file()]

        def warm() -> None:
            subprocess.run([*fetch, "--offline"], env={**env, "COMPILESVC_CACHE_DIR": cache}, check=True,
                           stdout=subprocess.DEVNULL)

        def sha256sum() -> None:
            subprocess.run(["sha256sum", *map(str, files)], check=True, stdout=subprocess.DEVNULL)

        results.append(_row("warm fetch (from cache, re-hashed)", median_seconds(warm, args.rounds),
                            "sha256sum of the same files", median_seconds(sha256sum, args.rounds), 1.5))

        def eight(shared: bool) -> Callable[[], None]:
            def run() -> None:
                base_dir = fresh_cache()
                procs = [subprocess.Popen(fetch, stdout=subprocess.DEVNULL, env={
                    **env, "COMPILESVC_CACHE_DIR": base_dir if shared else f"{base_dir}/{n}"}) for n in range(8)]
                assert all(p.wait() == 0 for p in procs)
            return run

        results.append(_row("8 processes, one shared cache", median_seconds(eight(True), args.rounds),
                            "8 processes, a cache each", median_seconds(eight(False), args.rounds), 1.0))

        lookup_token = {"Authorization": f"Bearer {fleet}"}

        def lookups(target: str) -> Callable[[], None]:
            def run() -> None:
                for _ in range(200):
                    with urllib.request.urlopen(urllib.request.Request(f"{base}/v1/artifacts/{target}",
                                                                       headers=lookup_token)):
                        pass
            return run

        def misses() -> None:
            for _ in range(200):
                try:
                    urllib.request.urlopen(urllib.request.Request(f"{base}/v1/artifacts/{'0' * 64}",
                                                                  headers=lookup_token))
                except urllib.error.HTTPError as exc:
                    assert exc.code == 404

        results.append(_row("200 lookups of an unknown key (404)", median_seconds(misses, args.rounds),
                            "200 lookups of a published key", median_seconds(lookups(key), args.rounds), 1.5))
        server.shutdown()
        app.extensions["compilesvc"].fetches.close()
        manifest_location = services.store.document_location(artifact_manifest_name(key))
        results.append(lookup_vs_presigned(workdir, args, s3, database, key, fleet, manifest_location))
        return 0 if all(results) else 1
    finally:
        if services is not None:
            services.close()
        if proc is not None:
            stop_weed(proc)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
