"""Service settings, read once from ``COMPILESVC_*`` environment variables.

Every process (API, relay, reaper, worker) builds one :class:`Settings`. The defaults are the embedded
mode: a SQLite ledger, a local artifact directory and kombu's filesystem broker under ``data_dir``,
so a fresh checkout runs with no external service.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import json
import math
import os
import secrets
import tempfile
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from compilesvc.config.model_prefixes import S3Prefix, parse_model_prefixes
from compilesvc.config.placeholders import placeholders, refusal
from compilesvc.hostinfo import host_memory_bytes
from compilesvc.spec.buckets import DEFAULT_MAX_ELEMENTS_PER_BUCKET, DEFAULT_MAX_ELEMENTS_PER_INPUT, ElementLimits
from compilesvc.spec.neuronx_cc_options import parse_extra_flags


# Here, not in compilesvc.notify.webhooks: every Settings() validates the setting, and importing webhooks (the ledger
# tables, SQLAlchemy) for it cost each CLI run ~0.6 s.
def parse_networks(text: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """``"127.0.0.0/8, 10.1.0.0/16"`` -> networks; a ValueError names the bad entry."""
    out = []
    for part in text.replace(",", " ").split():
        try:
            out.append(ipaddress.ip_network(part, strict=False))
        except ValueError:
            raise ValueError(f"{part!r} is not a network (e.g. 10.0.0.0/8)") from None
    return tuple(out)


#: Host memory one tensor-parallel rank is assumed to need while neuronx-distributed's parallel_model_trace
#: compiles ranks side by side: each rank process loads the whole model and runs its own neuronx-cc, which
#: needs several GB for small models and tens of GB for large ones (docs/neuron-hosts.md, "Memory"). An
#: estimate for the default only; an operator who knows the models sets the bound itself.
RANK_COMPILE_MEMORY_BYTES = 16 * 1024**3


def default_parallel_rank_compiles() -> int:
    """How many ranks may compile at once by default: host memory / :data:`RANK_COMPILE_MEMORY_BYTES`, >= 1."""
    memory = host_memory_bytes()
    return max(1, memory // RANK_COMPILE_MEMORY_BYTES) if memory else 1


#: Retries of a compile failing with no diagnosis (the setting's default, and the ledger API's).
DEFAULT_UNKNOWN_FAILURE_RETRIES = 2


class Settings(BaseSettings):
    # hide_input_in_errors: a refused setting's message never repeats its value (it may be a secret, and the
    # worker's and relay's start errors print the whole ValidationError).
    model_config = SettingsConfigDict(env_prefix="COMPILESVC_", extra="ignore", hide_input_in_errors=True)

    data_dir: Path = Field(default=Path(".compilesvc"), description="Root for embedded-mode state.")
    database_url: str | None = Field(default=None, description="SQLAlchemy URL; default SQLite in data_dir.")
    store_url: str | None = Field(
        default=None, description="file:///abs/dir or s3://bucket/prefix; default data_dir/artifacts."
    )
    s3_endpoint_url: str | None = None
    s3_region: str = "us-east-1"
    broker_url: str | None = Field(default=None, description="Celery broker; default filesystem in data_dir.")
    broker_key_prefix: str = Field(
        default="", max_length=200,
        description="Prefix of every Redis key, so several deployments (or test runs) can share one Redis.",
    )

    public_url: str = Field(default="http://127.0.0.1:8080", description="How clients reach the API.")
    secret_key: str | None = Field(default=None, description="HMAC key for local-store download URLs.")
    signing_key_file: Path | None = Field(
        default=None, description="PEM ECDSA P-256 private key that signs published artifacts (mode 0600); default: "
                                  "one generated in data_dir (signing-key.pem, public key beside it).")
    publish_unsigned: bool = Field(
        default=False, description="Publish artifacts without a signature (fleets then refuse them).")
    url_ttl_seconds: int = Field(default=3600, ge=60, le=7 * 24 * 3600)
    spool_dir: Path | None = Field(
        default=None, description="Where S3 uploads without a declared digest spool while hashing (needs "
                                  "max_upload_bytes free); default TMPDIR."
    )
    max_upload_bytes: int = Field(default=8 * 1024**3, ge=1)
    abandoned_upload_seconds: int = Field(
        default=3600, ge=60,
        description="An upload idle this long (no part sent to S3, no byte written locally) is abandoned and "
                    "removed by the relay's sweep. It bounds a pause, not an upload's length.",
    )
    max_request_bytes: int = Field(default=1024**2, ge=1024)
    # Why these defaults: compilesvc/spec/compile_spec.py, next to them. Refused at submit (422), before a compile runs.
    max_elements_per_input: int = Field(
        default=DEFAULT_MAX_ELEMENTS_PER_INPUT, ge=1, description="Most elements (product of the shape) per input."
    )
    max_elements_per_bucket: int = Field(
        default=DEFAULT_MAX_ELEMENTS_PER_BUCKET, ge=1, description="Most elements of all a bucket's inputs together."
    )
    allow_file_models: bool = Field(default=False, description="Accept file:// model URIs (embedded/dev).")
    extra_compiler_flags: str = Field(
        default="",
        description="neuronx-cc option names accepted beyond the built-in table (comma- or space-separated), "
                    "e.g. an undocumented option or one of an SDK release newer than the table; kept in the key.",
    )

    # Access: docs/security.md.
    bootstrap_token: SecretStr | None = Field(
        default=None,
        description="An admin token (csvc_ + at least 27 characters) the API registers at start unless its hash "
                    "is known; revoking it sticks. For a first admin without ledger access (compose, Kubernetes).")
    allow_placeholder_secrets: bool = Field(
        default=False, description="Start although a secret is a 'change-me' placeholder (a development stack "
                                   "only; compilesvc/config/placeholders.py).")
    open_reads: bool = Field(
        default=False, description="Reads (history, builds, logs, workers, artifact lookups) need no token.")
    public_metrics: bool = Field(default=True, description="/metrics needs no token (false: a read token).")
    team_reads: bool = Field(
        default=False, description="A non-admin token reads only its own team's builds, logs, artifacts, stats "
                                   "(docs/security.md, 'Team boundary for reads'); admins read everything.")
    token_cache_seconds: float = Field(
        default=10.0, ge=0,
        description="How long an API process trusts a token it has checked: a revoked or expired token stops "
                    "working within this many seconds (0: every request asks the ledger).")
    submit_rate_limit: str = Field(
        default="120/minute",
        description="Submits per token, as `N/second|minute|hour|day` (several: `10/second;600/hour`); past it, 429 "
                    "with Retry-After. Counted in Redis when the broker is Redis (every API process together), "
                    "else per API process.")
    max_compiles_per_token: int = Field(
        default=256, ge=0,
        description="Bucket compiles one token may have queued or running at once (admin tokens: no limit; 0: "
                    "no limit). A submit past it is a 429.")
    max_upload_bytes_admin: int | None = Field(
        default=None, ge=1, description="Largest model upload of an admin token (default: max_upload_bytes).")
    webhook_secret: SecretStr | None = Field(
        default=None, description="HMAC-SHA256 key of webhook signatures; default: derived from secret_key.")
    webhook_allow_networks: str = Field(
        default="", description="Networks (CIDR, comma-separated) webhooks may call although their addresses are "
                                "loopback, link-local, private or reserved, e.g. 10.20.0.0/16.")
    team_webhooks: dict[str, list[str]] = Field(
        default_factory=dict, description='URLs every build of a team notifies, as JSON: {"vision": ["https://…"]}.')
    # NoDecode: the JSON is read by _model_prefixes, so that "" (compose's "not set") is {} rather than an error.
    model_s3_prefixes: Annotated[dict[str, list[str]], NoDecode] = Field(
        default_factory=dict,
        description='The S3 prefixes each team may name as its model (read with the service\'s S3 role), as JSON: '
                    '{"vision": ["s3://vision-models/"], "*": ["s3://shared-public-models/"]}; "*" is every team '
                    'and a request without a token. Unset: no s3:// model for anyone (docs/security.md, '
                    '"Model sources").')
    webhook_max_attempts: int = Field(default=8, ge=1, description="Tries of one webhook delivery.")
    webhook_retry_seconds: float = Field(default=5.0, ge=0, description="First webhook retry delay (then doubling).")
    idempotency_key_seconds: int = Field(
        default=24 * 3600, ge=60, description="How long a token's Idempotency-Key replays its first answer.")
    retention_min_age_days: float = Field(
        default=30.0, ge=0, description="compilesvc gc: an unpinned artifact published longer ago than this ...")
    retention_unfetched_days: float = Field(
        default=30.0, ge=0, description="... and not fetched by key for this long is deleted.")
    retention_retired_sdks: str = Field(
        default="", description="Releases whose unpinned artifacts gc deletes at any age once not fetched for "
                                "retention_unfetched_days, comma-separated: 2.19.0, or cpu:2.12.0 for one target.")
    gc_grace_seconds: float = Field(
        default=3600.0, ge=0, description="compilesvc gc removes an artifact's files this long after marking it "
                                          "deleted (API processes trust a cached artifact for 60 s).")

    # Disowns every earlier key at once (poisoned artifacts): part of every key.
    key_salt: str = ""

    lease_seconds: int = Field(default=60, ge=2)
    heartbeat_seconds: float = Field(default=10.0, gt=0)
    worker_stale_seconds: int = Field(default=90, ge=2)
    max_attempts: int = Field(default=3, ge=1)
    unknown_failure_retries: int = Field(
        default=DEFAULT_UNKNOWN_FAILURE_RETRIES, ge=0,
        description="How many times a compile that failed with no diagnosis (class 'unknown': e.g. exit 70 with "
                    "no error code) is retried before it is reported as such; always within max_attempts.")
    compile_timeout_seconds: int = Field(default=4 * 3600 + 1800, ge=1)
    drain_seconds: float = Field(
        default=20.0, ge=0,
        description="A worker told to stop (SIGTERM) lets its running compiles go on this long, then hands the "
                    "ones still compiling back to the queue, their attempt not counted (workers/compiling/drain.py). "
                    "Keep it about 10 s below the grace period before SIGKILL (Kubernetes' "
                    "terminationGracePeriodSeconds, Compose's stop_grace_period).")
    spot_notice: bool = Field(
        default=False, description="Watch the EC2 instance metadata for a spot interruption notice (every 5 s) and "
                                   "drain on one with spot_drain_seconds (workers/host/spot.py).")
    spot_drain_seconds: float = Field(
        default=90.0, ge=0, le=110,
        description="The drain window after a spot interruption notice: inside EC2's two minutes, with time "
                    "left to hand back what is still compiling.")
    liveness_check_seconds: float = Field(
        default=60.0, gt=0,
        description="How often a worker with a free compile slot proves it still consumes: it sends a canary "
                    "message to a queue only it reads (compile.canary.<worker id>) and must receive it "
                    "(workers/liveness.py). With every slot busy the check is skipped.")
    # Above kombu's longest wait between reconnect attempts (30 s: Connection._ensure_connection's interval_max,
    # kombu/connection.py:469 in 5.7.0, which Celery's consumer uses, celery/worker/consumer/consumer.py:690):
    # a consumer reconnecting after a long outage is slow, not wedged.
    liveness_bound_seconds: float = Field(
        default=60.0, gt=0,
        description="A canary (or any message) must arrive within this long, or the worker stops advertising "
                    "itself, lets its running compiles finish and exits 75 for its supervisor to restart it.")
    liveness_file: Path | None = Field(
        default=None,
        description="Where this worker or relay writes its liveness (compilesvc/liveness.py), which `compilesvc "
                    "worker --check-alive` and `python -m compilesvc.liveness worker|relay` read (default: "
                    "compilesvc-<process>.<hostname>.alive in the temp directory, compilesvc/liveness.py).")
    relay_liveness_seconds: float = Field(
        default=120.0, gt=0,
        description="A relay whose loop has not come round within this long (plus its back-off wait) is not alive "
                    "to `python -m compilesvc.liveness relay`: a pass hung on a ledger or broker socket that "
                    "no timeout sees (a proxy that stopped forwarding). A pass that fails and backs off is alive.")
    imds_url: str = Field(default="http://169.254.169.254", description="The EC2 instance metadata service.")
    kubernetes_protect: bool = Field(
        default=False, description="On Kubernetes: while compiling, annotate this worker's pod (pod-deletion-cost, "
                                   "karpenter.sh/do-not-disrupt) so scale-in and consolidation spare it "
                                   "(workers/host/pod_protection.py; needs POD_NAME, POD_NAMESPACE and a token).")
    neuron_max_parallel_rank_compiles: int = Field(
        default_factory=default_parallel_rank_compiles, ge=1,
        description="Most tensor-parallel ranks of one Neuron compile that compile at the same time (SDKs whose "
                    "tp > 1 path is parallel_model_trace, where each rank is a process with its own model and "
                    "compiler). Default: host memory / 16 GiB, at least 1. Not part of any key.")
    # Caps on extracting an hf-dir model archive (workers/compiling/archive_limits.py); past one: a compile error.
    hf_extract_max_bytes: int = Field(default=256 * 1024**3, ge=1, description="Most bytes an hf-dir archive "
                                      "may expand to (default 256 GiB).")
    hf_extract_max_files: int = Field(default=10_000, ge=1, description="Most members an hf-dir archive may have.")
    hf_extract_max_ratio: float = Field(default=100.0, gt=0, description="Most times its own size an hf-dir "
                                        "archive may expand to (checked past 64 MiB).")
    # Pinning an S3 model (compilesvc/pinning/hash_jobs.py): an un-remembered object without S3's own SHA-256 larger
    # than this is hashed in the background, once across the API processes, while its submit answers 503.
    pin_inline_hash_max_mb: int = Field(default=256, ge=0, description="Largest S3 model object (MiB) hashed "
                                        "inside the request that pins it; larger ones are hashed in the background.")
    pin_hash_lease_seconds: float = Field(default=60.0, ge=1, description="A background hash's lease: one not "
                                          "renewed for this long (its process died) is taken over by the next "
                                          "request for the object.")
    relay_interval_seconds: float = Field(default=0.5, gt=0)
    # The compile sandbox (workers/isolation/sandbox.py, docs/security.md): a compile runs the model, so it runs
    # isolated.
    sandbox: Literal["bwrap", "pod", "off"] = Field(
        default="bwrap", description="bwrap: every compile child runs in bubblewrap (the worker refuses to start "
                                     "where it cannot); pod: a compile runner in a secret-less container of the "
                                     "pod runs it (workers/isolation/compile_runner.py); off: the operator isolates "
                                     "compiles another way.")
    # COMPILESVC_SANDBOX=pod: the volume shared with the compile container (docs/deploy.md, "Compile isolation").
    compile_spool: Path | None = Field(
        default=None, description="pod mode: the spool directory shared with the compile runner's container.")
    compile_runner_pickup_seconds: float = Field(
        default=30.0, gt=0, description="pod mode: an attempt the runner has not taken within this is infra.")
    compile_runner_stale_seconds: float = Field(
        default=15.0, gt=0, description="pod mode: a runner heartbeat older than this means the runner is gone.")
    # The egress proof (workers/isolation/egress.py): endpoints a compile's network must not reach.
    egress_canaries: str = Field(
        default="", description="host:port endpoints of the service (API, ledger, broker, S3), comma-separated, "
                                "that a compile's network must not reach: probed from inside the sandbox at "
                                "worker start (bwrap) and by the compile runner before every compile (pod); "
                                "one reached refuses to start or compile (exit 78).")
    egress_acknowledged: bool = Field(
        default=False, description="Compile even if a canary of COMPILESVC_EGRESS_CANARIES is reachable from the "
                                   "compile's network (logged loudly); docs/deploy.md, 'Compile isolation'.")
    sandbox_user: str = Field(default="nobody", description="Whom a root worker runs compiles as (name or uid[:gid]).")
    sandbox_memory_mb: int = Field(default=0, ge=0, description="Address space of one compile process; 0: host RAM.")
    sandbox_max_processes: int = Field(default=1024, ge=16, description="Processes of the sandbox user.")
    sandbox_max_open_files: int = Field(default=4096, ge=64)
    sandbox_max_file_mb: int = Field(default=64 * 1024, ge=1, description="Largest file a compile may write.")
    sandbox_max_disk_mb: int = Field(default=256 * 1024, ge=1, description="Bytes a compile may leave on disk.")
    sandbox_tmp_mb: int = Field(default=2048, ge=16, description="Size of the compile's private /tmp (memory).")
    sandbox_max_log_mb: int = Field(default=256, ge=1, description="Output a compile may print (kept and logged).")
    sandbox_read_paths: str = Field(
        default="", description="Extra read-only paths for compiles, comma-separated (e.g. /opt/aws/neuron).")
    require_live_worker: bool = True
    scalable_queues: str = Field(
        default="", description="Queues a pool that scales from zero serves, comma-separated: a submit to one is "
                                "queued although no worker is alive yet, for the pool's scaler (KEDA) to wake it. "
                                "The Helm chart renders it from its KEDA pools.")

    # Infrastructure retries (a requeued attempt, a failed publish) wait base * 2**(n-1), jittered, capped.
    retry_backoff_seconds: float = Field(default=5.0, ge=0, description="First retry delay (then doubling).")
    retry_backoff_max_seconds: float = Field(default=600.0, ge=0, description="Longest retry delay.")
    store_retry_seconds: float = Field(
        default=1800.0, ge=0,
        description="How long an attempt keeps retrying an unreachable store, while fetching its model and "
                    "while publishing its outputs, before it gives up (the compiled output is still on the "
                    "worker meanwhile: a new attempt would compile again).",
    )

    ledger_retry_seconds: float = Field(
        default=30.0, ge=1,
        description="How long a worker retries a ledger write (its claim, its result) through a database "
                    "restart or failover before giving up (a claim then returns its message to the broker).",
    )
    # The reconciler (in `compilesvc relay`) re-sends a queued compile whose message is in neither the
    # queue nor the broker's unacked set for this long: a broker that restarted empty or was flushed.
    dispatch_grace_seconds: float = Field(default=30.0, ge=0.5)
    # The relay's watch for work nobody takes (compilesvc/compiles/unclaimed.py): well above the reconciler's
    # re-send (two looks dispatch_grace_seconds apart) and its claim window (ledger retry + grace + 60 s), so
    # only a re-send that is itself left unclaimed this long tells a worker to stop.
    unclaimed_after_seconds: float = Field(
        default=300.0, ge=1,
        description="A compile dispatched this long ago and still unclaimed, while a worker of its queue has had "
                    "a free slot and claimed nothing for as long, is reported; that worker is told to stop.")
    relay_metrics_port: int | None = Field(
        default=None, ge=0, le=65535,
        description="`compilesvc relay` serves Prometheus metrics on this port (unset: no endpoint).")
    relay_metrics_bind: str = Field(default="0.0.0.0", description="The address the relay's metrics endpoint binds.")
    broker_visibility_timeout_seconds: int | None = Field(
        default=None, ge=60,
        description="Redis redelivers an unacked message after this; default: the hard task limit + 1 h. "
                    "Must exceed the hard task limit, or an hours-long compile is delivered twice.",
    )
    broker_unacked_restore_seconds: int = Field(
        default=60, ge=1, description="How often workers sweep the broker's unacked set for expired messages.",
    )
    broker_socket_timeout_seconds: float = Field(
        default=10.0, gt=0, description="A broker command (a publish) waiting longer than this fails.",
    )

    @field_validator("database_url", "store_url", "s3_endpoint_url", "broker_url", "secret_key", "bootstrap_token",
                     "webhook_secret", "relay_metrics_port", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        # Compose files and shells pass "" for "not set"; boto3 and SQLAlchemy reject an empty URL.
        return None if value == "" else value

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, value: str | None) -> str | None:
        if value and value.startswith("sqlite"):
            try:
                from compilesvc.ledger.engine import sqlite_timeout  # SQLAlchemy: only when a SQLite URL is given
            except ModuleNotFoundError:  # a client install: the server checks it when it starts
                return value
            sqlite_timeout(value)  # a ValueError names the bad timeout
        return value

    @field_validator("submit_rate_limit")
    @classmethod
    def _rate_limit(cls, value: str) -> str:
        try:
            from limits import parse_many  # only when Settings are built: importing config stays light
        except ModuleNotFoundError:  # a client install, which limits nothing: the API checks it when it starts
            return value
        try:
            parse_many(value)
        except ValueError:
            raise ValueError(f"{value!r}: expected N/second, N/minute, N/hour or N/day (several with ';')") from None
        return value

    @field_validator("webhook_allow_networks")
    @classmethod
    def _networks(cls, value: str) -> str:
        parse_networks(value)
        return value

    @field_validator("model_s3_prefixes", mode="before")
    @classmethod
    def _model_prefixes_json(cls, value: object) -> object:
        if isinstance(value, str):  # from the environment
            try:
                return json.loads(value) if value.strip() else {}
            except json.JSONDecodeError as exc:
                raise ValueError(f"not JSON ({exc.msg}): expected {{\"team\": [\"s3://bucket/prefix/\"]}}") from None
        return value

    @field_validator("model_s3_prefixes")
    @classmethod
    def _model_prefixes(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        parse_model_prefixes(value)  # a ValueError names the bad team or prefix
        return value

    @cached_property  # read by every submit: parsed once
    def scalable_queue_names(self) -> frozenset[str]:
        """:attr:`scalable_queues` as names."""
        return frozenset(name.strip() for name in self.scalable_queues.split(",") if name.strip())

    @cached_property  # read by every submit: parsed once
    def model_prefixes(self) -> dict[str, tuple[S3Prefix, ...]]:
        """:attr:`model_s3_prefixes` parsed (:mod:`compilesvc.config.model_prefixes`)."""
        return parse_model_prefixes(self.model_s3_prefixes)

    @cached_property  # read by every submit: parsed once
    def webhook_networks(self) -> tuple[Any, ...]:
        return parse_networks(self.webhook_allow_networks)

    @cached_property
    def resolved_webhook_secret(self) -> bytes:
        if self.webhook_secret is not None:
            return self.webhook_secret.get_secret_value().encode()
        return hmac.new(self.resolved_secret_key, b"compilesvc-webhooks", hashlib.sha256).hexdigest().encode()

    @property
    def upload_limits(self) -> tuple[int, int]:
        """The largest upload of a submit token, and of an admin token."""
        return self.max_upload_bytes, self.max_upload_bytes_admin or self.max_upload_bytes

    @field_validator("extra_compiler_flags")
    @classmethod
    def _option_names(cls, value: str) -> str:
        parse_extra_flags(value)  # a ValueError names the bad entry
        return value

    @property
    def extra_flags(self) -> frozenset[str]:
        """:attr:`extra_compiler_flags` as option names (for :func:`compilesvc.spec.parsing.parse_spec`)."""
        return parse_extra_flags(self.extra_compiler_flags)

    @property
    def element_limits(self) -> ElementLimits:
        return ElementLimits(per_input=self.max_elements_per_input, per_bucket=self.max_elements_per_bucket)

    @cached_property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'compilesvc.db').resolve()}"

    @cached_property
    def resolved_store_url(self) -> str:
        if self.store_url:
            return self.store_url
        return (self.data_dir / "artifacts").resolve().as_uri()

    @cached_property
    def resolved_broker_url(self) -> str:
        return self.broker_url or "filesystem://"

    @cached_property
    def broker_folder(self) -> Path:
        return (self.data_dir / "broker").resolve()

    @cached_property
    def resolved_secret_key(self) -> bytes:
        """The configured key, or one generated once and kept in data_dir (embedded mode)."""
        if self.secret_key:
            return self.secret_key.encode()
        path = self.data_dir / "secret_key"
        if not path.exists():
            # Several processes start at once (gunicorn's workers, the worker and relay of `compilesvc dev`)
            # and must end up with one key: each writes its own temp file, the first link wins, and every
            # process reads the winner's. A shared temp name let one process's rename pull the file from
            # under another, and a replace would let the last writer change a key already in use.
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".secret_key.", dir=path.parent)  # created 0600
            try:
                with os.fdopen(fd, "w") as out:
                    out.write(secrets.token_hex(32))
                with contextlib.suppress(FileExistsError):
                    os.link(tmp, path)
            finally:
                os.unlink(tmp)
        return path.read_text().strip().encode()

    @property
    def task_hard_limit_seconds(self) -> int:
        """Celery's hard limit sits above everything an attempt may legitimately spend (the compile's own
        timeout, and store retries while fetching and publishing), so our limits fire first and are
        classified, and a publish riding out a store outage is never killed with its output."""
        return self.compile_timeout_seconds + 2 * math.ceil(self.store_retry_seconds) + 600

    @property
    def visibility_timeout_seconds(self) -> int:
        # Redis re-delivers unacked messages after this; it must outlive the longest task or tasks run twice.
        return self.broker_visibility_timeout_seconds or self.task_hard_limit_seconds + 3600

    @model_validator(mode="after")
    def _check_timings(self) -> Settings:
        if self.broker_visibility_timeout_seconds is not None and \
                self.broker_visibility_timeout_seconds <= self.task_hard_limit_seconds:
            raise ValueError(
                f"broker_visibility_timeout_seconds ({self.broker_visibility_timeout_seconds}) must exceed the "
                f"hard task limit ({self.task_hard_limit_seconds} s = compile_timeout_seconds + 2 x "
                f"store_retry_seconds + 600): Redis would "
                f"deliver a running compile's message a second time")
        if self.retry_backoff_max_seconds < self.retry_backoff_seconds:
            raise ValueError("retry_backoff_max_seconds must be at least retry_backoff_seconds")
        if self.team_reads and self.open_reads:
            # A read without a token has no team: the two settings cannot both hold.
            raise ValueError("team_reads and open_reads (COMPILESVC_TEAM_READS, COMPILESVC_OPEN_READS) contradict "
                             "each other (a read without a token has no team); set one of them")
        return self

    @model_validator(mode="after")
    def _no_placeholder_secrets(self) -> Settings:
        if not self.allow_placeholder_secrets:
            found = placeholders({
                "secret_key": self.secret_key, "database_url": self.database_url, "broker_url": self.broker_url,
                "bootstrap_token": self.bootstrap_token.get_secret_value() if self.bootstrap_token else None,
                "webhook_secret": self.webhook_secret.get_secret_value() if self.webhook_secret else None,
            }, os.environ)
            if found:
                raise ValueError(refusal(found))
        return self
