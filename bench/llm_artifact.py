"""An LLM's compiled directory as one artifact: published and fetched in bounded memory, fetched cold as fast as curl.

Run from the repository root: ``python -m bench.llm_artifact [--size-mib 4096] [--rounds 3] [--small-files 200]``.

The artifact is one bucket whose files have the layout of an NxD Inference compiled directory
(neuronx-distributed-inference ``models/application_base.py``: ``model.pt``, ``neuron_config.json`` and, when
pre-sharded, ``weights/tp{rank}_sharded_checkpoint.safetensors``), at ``--size-mib`` in all: ``model.pt`` 3/8
of it (1.5 GiB at 4 GiB), 8 weight shards sharing the rest (~320 MiB each), and ``--small-files`` files of 1-8
KiB (tokenizer and aux files). The bytes are synthetic: one random MiB, rotated and stamped with the file's and
the chunk's number, so no two chunks are alike and nothing compresses; nothing holds more than a chunk in memory.

1. **Publish** through the worker's own path (:mod:`compilesvc.compiles.publishing`: the lease, every file
   streamed to the store with its sha256, the compile log, the bucket manifest, the artifact manifest, its
   signature, the ledger) in a child process, whose extra peak RSS is ``VmHWM`` after minus ``VmRSS`` before
   (the counter reset through ``/proc/self/clear_refs``, as :mod:`bench.stream_memory` measures). Into the S3
   store (``weed mini``) and, unless ``--no-local``, a local store. Target: < ``--limit-mb`` (100 MB).
2. **Fetch cold** with ``compilesvc fetch KEY`` into an empty cache (a separate process; its peak RSS is the
   kernel's ``ru_maxrss`` of that child), ``--rounds`` times, each round beside ``curl`` of every presigned
   URL then ``sha256sum`` of the files (the baseline :mod:`bench.fleet_fetch` uses, from
   :mod:`bench._fetch_compare`), interleaved so the host's load falls on both alike. Targets: median time
   at most 1.2x the baseline's; the fetch's peak RSS less that of the same command fetching a one-file artifact
   < ``--limit-mb``.

The spec is a one-bucket torchscript spec standing in for the NxDI one: what is measured is the artifact's
files, not the key. Disk: about 2.25x ``--size-mib`` at the peak (two copies at a time: the source and a
store's, then the S3 server's and one fetched copy), checked before anything is written. Everything is
written under one temporary directory, removed at the end whatever happens. Every figure also goes to the one
table (:mod:`bench._table`). Exit status 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._fetch_compare import compare_row, curl_and_sha256sum, run_measured  # noqa: E402
from bench._proc import status_kib  # noqa: E402
from bench._table import record  # noqa: E402  (after the path, so it runs from anywhere)

MiB = 1024 * 1024
MB = 1000 * 1000
FETCH_RATIO_TARGET = 1.2
SHARDS = 8
WORKER = "bench-llm-artifact"
#: A few of the small files get the names a Hugging Face checkpoint's tokenizer has; the rest are numbered.
NAMED_SMALL = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json")


@dataclass(frozen=True)
class PlannedFile:
    path: str
    size: int
    role: str  # the manifest's role (docs/api.md): model, weights-shard, aux


def llm_layout(total: int, small_files: int) -> list[PlannedFile]:
    """The files of an NxDI compiled directory of ``total`` bytes: model.pt, the config, 8 weight shards
    and ``small_files`` small ones (1-8 KiB each)."""
    small = [PlannedFile("neuron_config.json", 4 * 1024, "aux")]
    for index in range(small_files):
        name = NAMED_SMALL[index] if index < len(NAMED_SMALL) else f"aux/file-{index:03d}.bin"
        small.append(PlannedFile(name, 1024 * (1 + index % 8), "aux"))
    model = total * 3 // 8
    rest = total - model - sum(f.size for f in small)
    if rest < SHARDS:
        raise ValueError(f"{total} bytes cannot hold model.pt, {SHARDS} shards and {len(small)} small files")
    shards = [PlannedFile(f"weights/tp{rank}_sharded_checkpoint.safetensors", rest // SHARDS
                          + (rest % SHARDS if rank == SHARDS - 1 else 0), "weights-shard") for rank in range(SHARDS)]
    return [PlannedFile("model.pt", model, "model"), *small, *shards]


def write_tree(root: Path, layout: list[PlannedFile], block: bytes) -> None:
    """Write ``layout`` under ``root``: each MiB is ``block`` rotated and stamped with (file, chunk) numbers."""
    for number, planned in enumerate(layout):
        path = root / planned.path
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as out:
            remaining, chunk = planned.size, 0
            while remaining:
                shift = (number * 7919 + chunk * 104729) % len(block)
                data = struct.pack("<QQ", number, chunk) + block[shift:] + block[:shift]
                n = min(len(block), remaining)
                out.write(data[:n])
                remaining -= n
                chunk += 1


# -- child: one publish, measured -------------------------------------------------------------------------


def _publish(args: argparse.Namespace) -> dict[str, Any]:
    from compilesvc.compiles import leases
    from compilesvc.compiles.publishing import archive_log, publish_outputs, publish_ready_artifacts
    from compilesvc.ledger.engine import transaction
    from compilesvc.services import Services
    from compilesvc.store.base import bucket_manifest_name
    from tests.fixtures.settings import make_settings

    services = Services.from_settings(make_settings(Path(args.api_dir), args.database, public_url=args.public_url,
                                                    store_url=args.store_url,
                                                    s3_endpoint_url=args.endpoint or None))
    out_dir = Path(args.out_dir)
    result = {"files": json.loads(args.files), "versions": {"neuronx-distributed-inference": "bench"},
              "compile_seconds": 0.0}
    compile_log = Path(args.api_dir) / "compile.log"
    compile_log.write_text("bench: an LLM-shaped directory, written by bench.llm_artifact\n")

    baseline = status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the peak read below is the publish's alone
    started = time.perf_counter()
    with transaction(services.sessions) as session:
        claim = leases.claim(session, args.bucket_id, WORKER, lease_seconds=3600)
    if claim is None:
        raise RuntimeError(f"bucket compile {args.bucket_id} could not be claimed")
    entry = archive_log(services.store, logs_path=compile_log, bucket_id=claim.bucket_id)
    manifest = publish_outputs(services.store, claim, out_dir, result, entry, WORKER)
    location = services.store.document_location(bucket_manifest_name(claim.key))
    with transaction(services.sessions) as session:
        if not leases.succeed(session, claim.bucket_id, claim.token, location, manifest.versions,
                              manifest.compile_seconds):
            raise RuntimeError("the lease was lost while publishing")
    publish_ready_artifacts(services.store, services.sessions, claim.bucket_id, signer=services.signer)
    seconds = time.perf_counter() - started
    peak = status_kib("VmHWM")
    services.close()
    return {"seconds": seconds, "baseline_bytes": baseline * 1024, "extra_bytes": max(0, peak - baseline) * 1024,
            "files": len(manifest.files), "bytes": sum(f.size for f in manifest.files)}


# -- parent -----------------------------------------------------------------------------------------------


@dataclass
class Ledger:
    """One API (the real app, SQLite ledger) over one store, with a client holding an admin token."""

    services: Any
    app: Any
    client: Any
    database: str
    api_dir: Path
    store_url: str
    public_url: str

    def submit(self, text: bytes, name: str) -> tuple[str, int]:
        """A one-bucket build of a new model: (its artifact key, its queued bucket compile's id)."""
        from tests.web.support import queued_buckets, spec_for

        uri = self.client.post("/v1/models", data=text, content_type="application/octet-stream").json["uri"]
        build = self.client.post("/v1/builds", json=spec_for(uri, buckets=((1, 128),), name=name)).json
        (bucket_id,) = queued_buckets(self.services, build["build_id"])
        return build["artifact_key"], bucket_id

    def publish(self, bucket_id: int, out_dir: Path, layout: list[PlannedFile], env: dict[str, str],
                endpoint: str) -> dict[str, Any]:
        """Publish ``out_dir`` as that bucket's output in a child process; what it measured."""
        files = json.dumps([{"path": f.path, "role": f.role} for f in layout])
        command = [sys.executable, "-m", "bench.llm_artifact", "--publish-child", "--api-dir", str(self.api_dir),
                   "--database", self.database, "--store-url", self.store_url, "--public-url", self.public_url,
                   "--endpoint", endpoint, "--out-dir", str(out_dir), "--bucket-id", str(bucket_id),
                   "--files", files]
        done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"publishing into {self.store_url} failed:\n{done.stderr}")
        return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _ledger(workdir: Path, name: str, store_url: str, endpoint: str | None, public_url: str) -> Ledger:
    from compilesvc.ledger.migrate import upgrade
    from compilesvc.services import Services
    from tests.fixtures.settings import make_settings
    from tests.fixtures.tokens import make_token
    from web.server.app import create_app

    database = f"sqlite:///{workdir / f'{name}.db'}"
    upgrade(database)
    api_dir = workdir / name
    services = Services.from_settings(make_settings(api_dir, database, public_url=public_url, store_url=store_url,
                                                    s3_endpoint_url=endpoint))
    app = create_app(services=services)
    client = app.test_client()
    client.environ_base["HTTP_AUTHORIZATION"] = f"Bearer {make_token(services.sessions, 'admin', owner='bench')}"
    return Ledger(services, app, client, database, api_dir, store_url, public_url)


def _free_space_check(workdir: Path, size: int) -> None:
    # The peak is two copies at once: the source beside the local store's or the S3 server's, then the S3
    # server's beside one fetched copy (the local store's is removed before the S3 publish, the source
    # before the fetches, each fetched copy before the next); an eighth more for weed's volumes.
    need = size * 9 // 4 + 512 * MiB
    free = shutil.disk_usage(workdir).free
    if free < need:
        raise SystemExit(f"error: {workdir} has {free / 2**30:.1f} GiB free; this run needs about "
                         f"{need / 2**30:.1f} GiB (pass a smaller --size-mib)")


def _publish_row(store: str, size_mib: int, big: dict[str, Any], tiny: dict[str, Any], limit_mb: float) -> bool:
    rate = big["bytes"] / MB / big["seconds"]
    print(f"publish ({store} store): {big['files']} files, {big['bytes'] / MB:.0f} MB in {big['seconds']:.1f} s "
          f"({rate:.0f} MB/s); extra peak RSS {big['extra_bytes'] / MB:.1f} MB (a one-file artifact: "
          f"{tiny['extra_bytes'] / MB:.1f} MB); target < {limit_mb:g} MB", flush=True)
    figure = record("llm_artifact", f"publish ({store} store), {size_mib} MiB LLM-shaped directory: extra peak RSS",
                    big["extra_bytes"] / MB, "MB", at_most=limit_mb,
                    vs="the publishing process's RSS just before (VmHWM reset)",
                    note=f"{big['files']} files, {rate:.0f} MB/s; a one-file artifact's publish: "
                         f"{tiny['extra_bytes'] / MB:.1f} MB")
    return figure.met is not False


def _load() -> str:
    return "/".join(f"{value:.1f}" for value in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.llm_artifact", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=4096, help="the artifact's size in all (default 4 GiB)")
    parser.add_argument("--small-files", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3, help="cold fetches, each beside one curl + sha256sum")
    parser.add_argument("--limit-mb", type=float, default=100.0, help="extra peak RSS allowed on either side")
    parser.add_argument("--no-local", action="store_true", help="publish into the S3 store only")
    parser.add_argument("--publish-child", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--api-dir", "--database", "--store-url", "--public-url", "--endpoint", "--out-dir", "--files"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--bucket-id", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.publish_child:
        print(json.dumps(_publish(args)))
        return 0
    if args.size_mib < 1 or args.rounds < 1 or args.small_files < 0:
        parser.error("--size-mib and --rounds must be at least 1, --small-files at least 0")
    for tool in ("curl", "sha256sum"):
        if shutil.which(tool) is None:
            raise SystemExit(f"error: {tool} is not on PATH (the baseline runs it)")
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    import logging

    from werkzeug.serving import make_server

    from bench._cluster import interrupt_on_signals
    from tests.fixtures.s3server import start_weed, stop_weed
    from tests.fixtures.signing import trust_env
    from tests.fixtures.tokens import make_token

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    size = args.size_mib * MiB
    layout = llm_layout(size, args.small_files)
    tiny_layout = [PlannedFile("neuron_config.json", 4 * 1024, "aux")]
    workdir = Path(tempfile.mkdtemp(prefix="llm-artifact-"))
    proc = None
    ledgers: list[Ledger] = []
    server = None
    with interrupt_on_signals():  # SIGTERM (bench.run_all's) cleans up as Ctrl-C does
        try:
            _free_space_check(workdir, size)
            print(f"load average {_load()} at the start; writing a {args.size_mib} MiB LLM-shaped directory "
                  f"({len(layout)} files) under {workdir} ...", flush=True)
            started = time.perf_counter()
            source, tiny = workdir / "compiled", workdir / "tiny"
            write_tree(source, layout, os.urandom(MiB))
            write_tree(tiny, tiny_layout, os.urandom(MiB))
            print(f"written in {time.perf_counter() - started:.1f} s; starting weed mini ...", flush=True)
            proc, s3 = start_weed(workdir / "weed")
            os.environ.update(s3.env())
            env = {**os.environ, "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"}
            env.pop("AWS_PROFILE", None)
            listener = socket.create_server(("127.0.0.1", 0))
            base = f"http://127.0.0.1:{listener.getsockname()[1]}"
            ok = True

            if not args.no_local:
                local = _ledger(workdir, "local", (workdir / "local-store").as_uri(), None, base)
                ledgers.append(local)
                _, tiny_bucket = local.submit(b"bench tiny model", "tiny")
                _, bucket = local.submit(b"bench llm model", "llama-shaped")
                small = local.publish(tiny_bucket, tiny, tiny_layout, env, "")
                print("publishing into the local store ...", flush=True)
                ok &= _publish_row("local", args.size_mib, local.publish(bucket, source, layout, env, ""), small,
                                   args.limit_mb)
                shutil.rmtree(workdir / "local-store", ignore_errors=True)  # its disk, before the fetches need theirs

            api = _ledger(workdir, "s3", f"s3://{s3.new_bucket('llm')}/artifacts", s3.endpoint_url, base)
            ledgers.append(api)
            tiny_key, tiny_bucket = api.submit(b"bench tiny model", "tiny")
            key, bucket = api.submit(b"bench llm model", "llama-shaped")
            small = api.publish(tiny_bucket, tiny, tiny_layout, env, s3.endpoint_url)
            print("publishing into the S3 store ...", flush=True)
            ok &= _publish_row("S3", args.size_mib, api.publish(bucket, source, layout, env, s3.endpoint_url), small,
                               args.limit_mb)
            shutil.rmtree(source)  # in the store now; the fetches need the disk

            server = make_server("127.0.0.1", 0, api.app, threaded=True, fd=listener.fileno())
            threading.Thread(target=server.serve_forever, daemon=True).start()
            fleet = make_token(api.services.sessions, "fleet", owner="fleet")
            described = api.client.get(f"/v1/artifacts/{key}")
            if described.status_code != 200:
                raise RuntimeError(f"artifact {key} is not published: {described.status_code} {described.json}")
            fetch_env = {**env, "COMPILESVC_TOKEN": fleet, "COMPILESVC_API_URL": base,
                         "COMPILESVC_CONFIG": "/nonexistent", **trust_env(api.services)}
            cache, curled = workdir / "cache", workdir / "curl"

            def cold(target: str) -> tuple[float, int]:
                shutil.rmtree(cache, ignore_errors=True)
                return run_measured([sys.executable, "-m", "compilesvc", "fetch", target, "-q"],
                                    {**fetch_env, "COMPILESVC_CACHE_DIR": str(cache)})

            tiny_peak = statistics.median(cold(tiny_key)[1] for _ in range(3))
            fetches: list[tuple[float, int]] = []
            baselines: list[float] = []
            print(f"fetching cold, {args.rounds} round(s), each beside curl + sha256sum of the same "
                  f"{len(layout)} files ...", flush=True)
            for round_number in range(args.rounds):
                fetches.append(cold(key))
                installed = cache / "v1" / "artifacts" / key / "bucket-0"
                fetched = [p for p in installed.rglob("*") if p.is_file()]
                wrong = [f.path for f in layout if not (installed / f.path).is_file()
                         or (installed / f.path).stat().st_size != f.size]
                if wrong or len(fetched) != len(layout):
                    raise RuntimeError(f"the fetched directory is not the published one: {len(fetched)} files, "
                                       f"{len(layout)} expected; missing or of another size: {wrong[:5]}")
                shutil.rmtree(cache)
                started = time.perf_counter()
                # The presigned URLs of one answer, fetched afresh per round as a boot script would.
                curl_and_sha256sum(api.client.get(f"/v1/artifacts/{key}").json, curled)
                baselines.append(time.perf_counter() - started)
                shutil.rmtree(curled)
                print(f"  round {round_number + 1}: compilesvc fetch {fetches[-1][0]:.1f} s (peak RSS "
                      f"{fetches[-1][1] / MB:.0f} MB, {len(fetched)} files installed), curl + sha256sum "
                      f"{baselines[-1]:.1f} s", flush=True)
            load = _load()
            seconds = statistics.median(t for t, _ in fetches)
            peak = max(p for _, p in fetches)
            ok &= compare_row("llm_artifact", f"cold fetch, {args.size_mib} MiB LLM-shaped directory", seconds,
                              "curl + sha256sum", statistics.median(baselines), FETCH_RATIO_TARGET,
                              note=f"{len(layout)} files, medians of {args.rounds}; load {load}")
            extra = peak - tiny_peak
            print(f"compilesvc fetch peak RSS {peak / MB:.1f} MB (most of {args.rounds}); fetching a one-file artifact "
                  f"{tiny_peak / MB:.1f} MB: {extra / MB:.1f} MB extra (target < {args.limit_mb:g} MB); load average "
                  f"{load} at the end", flush=True)
            memory = record("llm_artifact", f"cold fetch, {args.size_mib} MiB LLM-shaped directory: extra peak RSS",
                            extra / MB, "MB", at_most=args.limit_mb,
                            vs="the same command fetching a one-file artifact (ru_maxrss of each)",
                            note=f"{peak / MB:.0f} MB vs {tiny_peak / MB:.0f} MB")
            ok &= memory.met is not False
            return 0 if ok else 1
        finally:
            if server is not None:
                server.shutdown()
            for ledger in ledgers:
                ledger.app.extensions["compilesvc"].fetches.close()
                ledger.services.close()
            if proc is not None:
                stop_weed(proc)
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
