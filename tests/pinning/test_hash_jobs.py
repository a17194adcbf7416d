"""Large S3 models hashed in the background (compilesvc/pinning/hash_jobs.py), against weed and both ledgers: the
pin answers ModelPinning while one process hashes the object, once however many pin it; the pin that follows is
the one an inline hash gives; a job whose hasher died is taken over once its lease expires; an object changed
while it was hashed fails its job with the reason."""

from __future__ import annotations

import hashlib
import threading
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from compilesvc.config.settings import Settings
from compilesvc.ledger.engine import transaction
from compilesvc.ledger.models import PinJob, utcnow
from compilesvc.pinning.hash_jobs import FAILED, HASHING, STORE_ATTEMPTS, HashJobs, ObjectVersion
from compilesvc.pinning.identity import ModelResolver
from compilesvc.pinning.pins import ModelPinning, ModelRefError, PinnedModel
from compilesvc.spec.compile_spec import ModelRef
from tests.fixtures.checkpoints import Checkpoints, sha256_file
from tests.fixtures.ports import free_port
from tests.fixtures.s3server import S3Server
from tests.fixtures.waiting import wait_for
from tests.pinning.test_identity import count_gets

MIB = 1024**2
LARGE = b"weights!" * (3 * MIB // 16)  # 1.5 MiB: above a 1 MiB threshold


@pytest.fixture(scope="module")
def bucket(s3_server: S3Server) -> str:
    return s3_server.new_bucket("large")


def settings_for(tmp_path: Path, s3: S3Server, **overrides: Any) -> Settings:
    return Settings(**{"data_dir": tmp_path / "data", "s3_endpoint_url": s3.endpoint_url, "s3_region": s3.region,
                       "pin_inline_hash_max_mb": 1, **overrides})


def put(s3: S3Server, bucket: str, data: bytes, name: str = "m.pt") -> str:
    key = f"t-{uuid.uuid4().hex[:12]}/{name}"
    s3.raw_client().put_object(Bucket=bucket, Key=key, Body=data)
    return f"s3://{bucket}/{key}"


def jobs(sessions: sessionmaker[Session]) -> list[Any]:
    with transaction(sessions) as session:
        return list(session.execute(select(PinJob.uri, PinJob.state, PinJob.sha256, PinJob.error)).all())


def pinned_when_done(resolver: ModelResolver, model: ModelRef, **kwargs: Any) -> PinnedModel:
    """Pin ``model`` as a waiting client does: again until the background hash is done."""
    def attempt() -> PinnedModel | None:
        try:
            return resolver.pin(model, **kwargs)
        except ModelPinning:
            return None
    return wait_for(attempt, 60, "the background hash", interval=0.05)


def test_a_large_object_is_hashed_in_the_background_once(
        tmp_path: Path, s3: S3Server, bucket: str, sessions: sessionmaker[Session]) -> None:
    uri = put(s3, bucket, LARGE)
    model = ModelRef(uri=uri, format="torchscript")
    resolver = ModelResolver(settings_for(tmp_path, s3), None, sessions)
    gets = count_gets(resolver)
    with pytest.raises(ModelPinning) as raised:
        resolver.pin(model)
    assert (raised.value.what, raised.value.total) == (uri, len(LARGE)) and raised.value.retry_after >= 2
    assert f"{uri} is being hashed to pin it" in str(raised.value)

    pinned = pinned_when_done(resolver, model)
    inline = ModelResolver(settings_for(tmp_path, s3, pin_inline_hash_max_mb=256), None, None).pin(model)
    assert pinned == inline and pinned.sha256 == hashlib.sha256(LARGE).hexdigest()
    assert jobs(sessions) == [(uri, "done", pinned.sha256, None)]
    assert gets == [1]  # the waiting pins read the job, never the object
    assert resolver.pin(model) == pinned  # remembered in model_pins from now on


def test_a_small_object_is_still_hashed_inline(
        tmp_path: Path, s3: S3Server, bucket: str, sessions: sessionmaker[Session]) -> None:
    small = b"w" * (MIB - 1)
    resolver = ModelResolver(settings_for(tmp_path, s3), None, sessions)
    pinned = resolver.pin(ModelRef(uri=put(s3, bucket, small), format="torchscript"))
    assert pinned.sha256 == hashlib.sha256(small).hexdigest()
    assert jobs(sessions) == []


def test_concurrent_pins_of_one_object_make_one_job_and_one_read(
        tmp_path: Path, s3: S3Server, bucket: str, sessions: sessionmaker[Session]) -> None:
    model = ModelRef(uri=put(s3, bucket, LARGE), format="torchscript")
    # Four resolvers: four API processes (each its own hasher identity) pinning at once.
    resolvers = [ModelResolver(settings_for(tmp_path, s3), None, sessions) for _ in range(4)]
    gets = [count_gets(resolver) for resolver in resolvers]
    barrier = threading.Barrier(len(resolvers))
    answers: list[str] = []

    def pin(resolver: ModelResolver) -> None:
        barrier.wait()
        try:
            answers.append(resolver.pin(model).sha256)
        except ModelPinning:
            answers.append("pinning")

    threads = [threading.Thread(target=pin, args=(resolver,)) for resolver in resolvers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert "pinning" in answers and set(answers) <= {"pinning", hashlib.sha256(LARGE).hexdigest()}
    for resolver in resolvers:
        assert pinned_when_done(resolver, model).sha256 == hashlib.sha256(LARGE).hexdigest()
    assert len(jobs(sessions)) == 1
    assert sum(count[0] for count in gets) == 1


def test_a_dead_hashers_job_is_taken_over_when_its_lease_expires(
        tmp_path: Path, s3: S3Server, bucket: str, sessions: sessionmaker[Session]) -> None:
    uri = put(s3, bucket, LARGE)
    model = ModelRef(uri=uri, format="torchscript")
    head = s3.raw_client().head_object(Bucket=bucket, Key=uri.split("/", 3)[3])
    obj = ObjectVersion(bucket, uri.split("/", 3)[3], None, head["ETag"], len(LARGE))
    # A process claimed the job, read some of the object and died: its row holds the lease until it expires.
    dead = HashJobs(ModelResolver(settings_for(tmp_path, s3), None, sessions).s3, sessions, lease_seconds=60)
    now = utcnow()
    with transaction(sessions) as session:
        session.add(PinJob(**obj.identity(), state=HASHING, bytes_done=MIB, owner=dead.owner,
                           lease_until=now + timedelta(seconds=60), created_at=now, updated_at=now))

    resolver = ModelResolver(settings_for(tmp_path, s3), None, sessions)
    gets = count_gets(resolver)
    with pytest.raises(ModelPinning) as raised:
        resolver.pin(model)
    assert (raised.value.done, raised.value.total) == (MIB, len(LARGE))  # the dead hasher's last progress
    assert "1.0 MiB of 1.5 MiB read, 66%" in str(raised.value)
    assert gets == [0]  # its lease holds: nobody else reads the object

    with transaction(sessions) as session:  # the lease runs out (its process never renews it)
        session.execute(update(PinJob).values(lease_until=utcnow() - timedelta(seconds=1)))
    pinned = pinned_when_done(resolver, model)
    assert pinned.sha256 == hashlib.sha256(LARGE).hexdigest() and gets == [1]
    assert jobs(sessions) == [(uri, "done", pinned.sha256, None)]


def test_an_object_changed_while_hashed_fails_its_job_with_the_reason(
        tmp_path: Path, s3: S3Server, bucket: str, sessions: sessionmaker[Session]) -> None:
    uri = put(s3, bucket, LARGE)
    key = uri.split("/", 3)[3]
    raw = s3.raw_client()
    obj = ObjectVersion(bucket, key, None, raw.head_object(Bucket=bucket, Key=key)["ETag"], len(LARGE))
    hasher = HashJobs(ModelResolver(settings_for(tmp_path, s3), None, sessions).s3, sessions, lease_seconds=60)
    now = utcnow()
    with transaction(sessions) as session:
        session.add(PinJob(**obj.identity(), state=HASHING, bytes_done=0, created_at=now, updated_at=now))
        session.flush()
    job_id = jobs_id(sessions)
    assert hasher.claim(job_id)
    replaced = b"other bytes" + LARGE[11:]  # same size, another ETag
    raw.put_object(Bucket=bucket, Key=key, Body=replaced)
    hasher.hash(job_id, obj)  # what the claiming process's thread runs

    (row,) = jobs(sessions)
    assert row.state == FAILED and row.error == (f"{uri} changed while it was being hashed (ETag {obj.etag} is "
                                                 "gone); submit again to pin the object as it is now")
    with pytest.raises(ModelRefError, match="changed while it was being hashed"):
        hasher.sha256(obj)  # a request for the object as it was gets the reason (a 422)
    # The object as it is now is another identity: hashed afresh.
    resolver = ModelResolver(settings_for(tmp_path, s3), None, sessions)
    pinned = pinned_when_done(resolver, ModelRef(uri=uri, format="torchscript"))
    assert pinned.sha256 == hashlib.sha256(replaced).hexdigest()


def jobs_id(sessions: sessionmaker[Session]) -> int:
    with transaction(sessions) as session:
        return int(session.scalar(select(func.max(PinJob.id))) or 0)


def test_a_checkpoints_large_weight_files_are_hashed_in_the_background_together(
        tmp_path: Path, s3: S3Server, sessions: sessionmaker[Session], tiny_checkpoints: Checkpoints) -> None:
    raw = s3.raw_client()
    bucket = s3.new_bucket("ckpt")
    raw.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    prefix = f"llama-{uuid.uuid4().hex[:8]}/"
    sharded = tiny_checkpoints.sharded
    for path in sorted(sharded.iterdir()):
        raw.put_object(Bucket=bucket, Key=prefix + path.name, Body=path.read_bytes())
    model = ModelRef(uri=f"s3://{bucket}/{prefix}", format="hf-checkpoint")
    # A threshold of 0: every weight file S3 holds no SHA-256 for is a background hash.
    resolver = ModelResolver(settings_for(tmp_path, s3, pin_inline_hash_max_mb=0), None, sessions)
    with pytest.raises(ModelPinning) as raised:
        resolver.pin(model, weight_digests=True)
    weights = ("model.safetensors.index.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    assert raised.value.what == f"3 weight file(s) under s3://{bucket}/{prefix}"
    assert raised.value.total == sum((sharded / name).stat().st_size for name in weights)
    assert len(jobs(sessions)) == 3  # each started by the one request, not one per retry

    pinned = pinned_when_done(resolver, model, weight_digests=True)
    inline = ModelResolver(settings_for(tmp_path, s3, pin_inline_hash_max_mb=256), None, None).pin(
        model, weight_digests=True)
    assert pinned == inline
    assert pinned.checkpoint is not None
    assert pinned.checkpoint.weights == {name: sha256_file(sharded / name) for name in weights}
    # The key without weight digests (a compile that does not pre-shard) never waits.
    assert resolver.pin(model).checkpoint is not None


def test_a_store_that_keeps_failing_the_read_fails_the_job_with_its_reason(
        tmp_path: Path, s3: S3Server, bucket: str, sessions: sessionmaker[Session]) -> None:
    """A read that fails (the store unreachable here; an object the store refuses to serve alike) releases the job
    for the next request, but not forever: after STORE_ATTEMPTS in a row the job fails with the store's reason, so a
    waiting client gets an answer instead of progress restarting from byte 0 for hours."""
    uri = put(s3, bucket, LARGE)
    key = uri.split("/", 3)[3]
    obj = ObjectVersion(bucket, key, None, s3.raw_client().head_object(Bucket=bucket, Key=key)["ETag"], len(LARGE))
    unreachable = settings_for(tmp_path, s3, s3_endpoint_url=f"http://127.0.0.1:{free_port()}")
    hasher = HashJobs(ModelResolver(unreachable, None, sessions).s3, sessions, lease_seconds=60)
    now = utcnow()
    with transaction(sessions) as session:
        session.add(PinJob(**obj.identity(), state=HASHING, bytes_done=0, created_at=now, updated_at=now))
    job_id = jobs_id(sessions)
    for attempt in range(1, STORE_ATTEMPTS + 1):
        assert hasher.claim(job_id), attempt  # released after each failure: claimable again at once
        hasher.hash(job_id, obj)
        (row,) = jobs(sessions)
        assert row.state == (FAILED if attempt == STORE_ATTEMPTS else HASHING), (attempt, row)
    assert row.error.startswith(f"reading {uri} failed {STORE_ATTEMPTS} times in a row (")
    with pytest.raises(ModelRefError, match=f"failed {STORE_ATTEMPTS} times in a row"):
        hasher.sha256(obj)


def test_an_object_with_s3s_full_object_sha256_is_never_read(
        tmp_path: Path, s3: S3Server, bucket: str, sessions: sessionmaker[Session]) -> None:
    """Uploaded in one part with a SHA-256 checksum (which S3 verified on the way in), a large object's pin takes
    S3's digest from the HEAD: no background job, no GET, the same sha256 the bytes give."""
    key = f"t-{uuid.uuid4().hex[:12]}/m.pt"
    s3.raw_client().put_object(Bucket=bucket, Key=key, Body=LARGE, ChecksumAlgorithm="SHA256")
    resolver = ModelResolver(settings_for(tmp_path, s3), None, sessions)
    gets = count_gets(resolver)
    pinned = resolver.pin(ModelRef(uri=f"s3://{bucket}/{key}", format="torchscript"))
    assert pinned.sha256 == hashlib.sha256(LARGE).hexdigest()
    assert gets == [0] and jobs(sessions) == []
