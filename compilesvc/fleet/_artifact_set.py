"""An artifact as serving code holds it: verified files on local disk, a bucket per compiled shape set,
the choice of bucket for a request, and (only when asked) the loaded model."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from compilesvc.client import config as client_config
from compilesvc.client.api import Api
from compilesvc.fleet._cache import ArtifactCache, Verify, default_cache_dir
from compilesvc.fleet._fetch import DEFAULT_PARALLEL, Fetcher, FetchReport, Progress, spec_digest
from compilesvc.fleet._host import HostCheck, HostReport, enforce
from compilesvc.fleet._llm import LLMArtifact, NotAnLLMArtifact
from compilesvc.fleet._remote import FleetError, Remote, Untrusted
from compilesvc.fleet._select import Shape, order_key, select
from compilesvc.signing.keys import KeyFileError, TrustedKeys
from compilesvc.spec.manifest import ArtifactBucketEntry, ArtifactManifest, bucket_dir

HOST_CHECK_ENV = "COMPILESVC_HOST_CHECK"
#: Retries of API calls at boot: enough for a restarting API, short enough that a cached set is not kept
#: waiting (a cached key never asks the API at all).
BOOT_RETRIES = 3


def _is_key(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


@dataclass(frozen=True)
class LocalBucket:
    """One compiled bucket on local disk: its shapes, its files by manifest path, the versions it was
    built with."""

    position: int
    key: str
    directory: Path
    inputs: tuple[dict[str, Any], ...]
    files: dict[str, Path]
    roles: dict[str, str]
    versions: dict[str, Any] = field(default_factory=dict)

    @cached_property
    def shapes(self) -> dict[str, Shape]:
        return {i["name"]: tuple(i["shape"]) for i in self.inputs}

    @cached_property
    def dtypes(self) -> dict[str, str]:
        return {i["name"]: str(i["dtype"]) for i in self.inputs}

    @property
    def model_path(self) -> Path:
        """The bucket's model file (role ``model``): what ``torch.jit.load`` or AOTInductor opens."""
        models = [self.files[path] for path, role in self.roles.items() if role == "model"]
        if len(models) != 1:
            raise FleetError(f"bucket {self.position} has {len(models)} files of role 'model' "
                             f"({', '.join(self.roles)}); load its directory {self.directory} with the "
                             "loader its backend documents")
        return models[0]

    def load(self) -> Any:
        """The model, loaded: ``torch.jit.load`` for TorchScript (``torch_neuronx`` imported first for a
        Neuron artifact: it registers the ops the NEFF runs through), AOTInductor's package loader for
        ``.pt2``. This is the one place the library imports torch."""
        path = self.model_path
        import torch

        if path.suffix == ".pt2":
            return torch._inductor.aoti_load_package(str(path))
        if self.versions.get("torch_neuronx"):
            import torch_neuronx  # noqa: F401  (registers the Neuron ops before the module is read)
        return torch.jit.load(str(path))  # type: ignore[no-untyped-call]


def _bucket(directory: Path, entry: ArtifactBucketEntry) -> LocalBucket:
    base = directory / bucket_dir(entry.position)
    return LocalBucket(position=entry.position, key=entry.key, directory=base, inputs=tuple(entry.inputs),
                       files={f.path: base / f.path for f in entry.files},
                       roles={f.path: f.role for f in entry.files}, versions=dict(entry.versions))


@dataclass
class ArtifactSet:
    """A published artifact, verified in the local cache; see :meth:`open`."""

    key: str
    manifest: ArtifactManifest
    directory: Path
    buckets: tuple[LocalBucket, ...]
    report: FetchReport
    host: HostReport

    @classmethod
    def open(cls, ref: str | os.PathLike[str] | Mapping[str, Any] | Any, *,
             cache_dir: str | os.PathLike[str] | None = None,
             api_url: str | None = None, token: str | None = None, offline: bool = False,
             verify: Verify | str = Verify.SHA256, host_check: HostCheck | str | None = None,
             with_logs: bool = False, parallel: int = DEFAULT_PARALLEL,
             progress: Progress | None = None, trusted_keys: TrustedKeys | None = None) -> ArtifactSet:
        """The verified local copy of an artifact, fetched into the cache if it is not there.

        ``ref`` is an artifact key (64 hex digits) or a spec (a spec file's path, a dict, or a
        :class:`compilesvc.spec.compile_spec.CompileSpec`), resolved to its key by the API, or offline by what the cache
        remembers from the last time it was fetched. A key (or a remembered spec) whose files are in the
        cache and verify is served with no network at all; the API is asked only for what is missing or
        damaged. ``cache_dir`` defaults to ``$COMPILESVC_CACHE_DIR`` (else ``~/.cache/compilesvc``) and may
        be read-only. The API and token default to the CLI's (``COMPILESVC_API_URL``,
        ``COMPILESVC_TOKEN``, the config file). ``host_check`` (default ``$COMPILESVC_HOST_CHECK``, else
        ``refuse``) compares the versions the artifact was built with against this host's.

        The manifest's signature is checked against ``trusted_keys`` (default: ``$COMPILESVC_TRUSTED_KEYS``,
        else ``trusted_keys`` in the client config file) before any file is used, cached or not, offline
        too; :class:`Untrusted` (a :class:`FleetError`) names what failed: the key id, the file.
        """
        if trusted_keys is None:
            try:
                trusted_keys = TrustedKeys.from_environment()
            except KeyFileError as exc:
                raise Untrusted(f"the trusted keys cannot be read: {exc}") from None
        cache = ArtifactCache(Path(cache_dir) if cache_dir is not None else default_cache_dir())
        remote = None if offline else _remote(api_url, token)
        fetcher = Fetcher(cache, remote, trusted=trusted_keys, verify=Verify(verify), parallel=parallel,
                          progress=progress)
        key, spec, key_source = _key_of(ref, fetcher)
        report = fetcher.fetch(key, with_logs=with_logs, spec=spec, key_source=key_source)
        policy = HostCheck(host_check or os.environ.get(HOST_CHECK_ENV) or HostCheck.REFUSE)
        host = enforce(key, (b.versions for b in report.manifest.buckets), policy)
        buckets = tuple(_bucket(report.directory, b) for b in report.manifest.buckets)
        return cls(key, report.manifest, report.directory, buckets, report, host)

    @cached_property
    def llm(self) -> LLMArtifact:
        """The artifact as NxD Inference's compiled directory (an LLM compile: one bucket, no inputs), with
        the InferenceConfig read from its neuron_config.json; :class:`NotAnLLMArtifact` for any other artifact."""
        if len(self.buckets) != 1:
            raise NotAnLLMArtifact(f"{self.key} is not an NxD Inference artifact: it has {len(self.buckets)} buckets, "
                                   "an LLM compile has one")
        bucket = self.buckets[0]
        return LLMArtifact.from_directory(bucket.directory, tuple(bucket.files), key=self.key)

    @property
    def compiled_model_path(self) -> Path:
        """NxD Inference's compiled directory (``<cache>/v1/artifacts/<key>/bucket-0``): what
        ``NEURON_COMPILED_ARTIFACTS`` and NxDI's ``load()`` take. :class:`NotAnLLMArtifact` for other artifacts."""
        return self.llm.compiled_model_path

    @cached_property
    def _by_preference(self) -> tuple[LocalBucket, ...]:
        return tuple(sorted(self.buckets, key=order_key))

    def select(self, inputs: Mapping[str, Any]) -> LocalBucket:
        """The bucket for a request (see :func:`compilesvc.fleet.select` for the policy and the error)."""
        chosen = select(self._by_preference, inputs)
        assert isinstance(chosen, LocalBucket)
        return chosen


def _remote(api_url: str | None, token: str | None) -> Remote:
    try:
        config = client_config.load(api_url)
    except client_config.ConfigError as exc:
        raise FleetError(str(exc)) from None
    return Remote(Api(config.api_url, token=token or config.token, retries=BOOT_RETRIES))


def _key_of(ref: Any, fetcher: Fetcher) -> tuple[str, dict[str, Any] | None, str]:
    """The key ``ref`` names, and for a spec the spec and where its key came from (the artifact is then checked to
    be the spec's: neither the API's answer nor the cache's ``specs/`` entry is signed)."""
    if isinstance(ref, str) and _is_key(ref):
        return ref, None, ""
    spec = _spec_document(ref)
    digest = spec_digest(spec)
    remembered = fetcher.cache.key_for_spec(digest)
    if remembered is not None and fetcher.cache.artifact_dir(remembered).is_dir():
        # Fetched before: no question to ask the API.
        return remembered, spec, f"the cache's entry {fetcher.cache.base / 'specs' / digest}"
    key, source = fetcher.key_and_source(spec)
    return key, spec, source


def _spec_document(ref: Any) -> dict[str, Any]:
    """A spec given as a file, a mapping or a CompileSpec, as the JSON document the API resolves."""
    # Only a fleet naming its artifact by spec loads pydantic and the release tables (start-up cost).
    from compilesvc.spec.compile_spec import CompileSpec
    from compilesvc.spec.parsing import SpecError, load_spec_file, parse_spec

    try:
        if isinstance(ref, CompileSpec):
            spec = ref
        elif isinstance(ref, Mapping):
            spec = parse_spec(dict(ref), limits=None, extra_flags=None)
        elif isinstance(ref, (str, os.PathLike)):
            if isinstance(ref, str) and not os.path.exists(ref):
                raise FleetError(f"{ref!r} is neither an artifact key (64 lowercase hex digits) nor a spec file")
            spec = load_spec_file(Path(ref), limits=None, extra_flags=None)
        else:
            raise FleetError(f"expected an artifact key or a spec, not {type(ref).__name__}")
    except SpecError as exc:
        raise FleetError(f"the spec is invalid: {exc}") from None
    document: dict[str, Any] = spec.model_dump(mode="json", exclude_none=True)
    document.pop("callbacks", None)  # where to notify is no part of what to load
    return document
