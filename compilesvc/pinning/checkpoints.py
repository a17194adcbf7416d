"""Hugging Face checkpoint directories (``hf-checkpoint`` models) pinned at submit: the files, the ``config.json``
the key needs, and (only for a compile that writes pre-sharded weights) the weight files' sha256.

Three forms of one directory:

- ``blob:sha256:<hex>``: a tar archive in the store (the form hf-dir uploads use: config.json at its root or in its
  single top-level directory). Its headers are read and config.json (at most
  :data:`~compilesvc.spec.checkpoint.CONFIG_MAX_BYTES`) is read out of it; nothing is extracted here. An
  uncompressed tar (what ``compilesvc upload DIR`` writes) is read by ranged reads of the store, so only its headers
  and the members the key reads cost anything; a compressed one (and any archive whose weights are hashed) is
  streamed. What it gave is remembered in the ledger by the blob's sha256, so it is read once. The worker
  fetches the archive and extracts it with its own caps (:mod:`workers.compiling.checkpoint_dirs`). Its model
  sha256 is the archive's.
- ``s3://bucket/prefix/``: every object pinned by version (:mod:`compilesvc.pinning.s3_prefixes`).
- ``file:///abs/dir`` (``settings.allow_file_models`` only): every file pinned by (path, size, mtime).

For the last two the model sha256 is a digest over the pinned file list (:func:`listing_sha256`), not over
the bytes: the files are pinned one by one, and the key of an NxDI compile holds the config (and the weights'
own digests when they matter), never this sha256. A checkpoint that is not one NxDI can read is a
:class:`~compilesvc.pinning.pins.ModelRefError` on ``model.uri`` (a 422).
"""

from __future__ import annotations

import hashlib
import os
import stat
import tarfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import IO, TYPE_CHECKING, Any

from sqlalchemy.exc import IntegrityError

from compilesvc.ledger.engine import transaction
from compilesvc.ledger.models import CheckpointPin
from compilesvc.pinning.pins import ModelChangedError, ModelRefError, PinnedModel
from compilesvc.spec import neuron_releases, nxdi_models
from compilesvc.spec.checkpoint import (
    CONFIG_MAX_BYTES,
    CONFIG_NAME,
    INDEX_MAX_BYTES,
    WEIGHT_LAYOUTS,
    CheckpointError,
    CheckpointMaterial,
    add_member,
    archive_member_path,
    checkpoint_files,
    parse_config,
    weight_layout,
    weight_layouts,
)
from compilesvc.spec.compile_spec import ModelRef
from compilesvc.spec.keys import digest
from compilesvc.store.base import StoreError
from compilesvc.store.hashing import CHUNK_SIZE
from compilesvc.store.tar_caps import ArchiveHeaderTooLarge, open_capped

if TYPE_CHECKING:
    from compilesvc.pinning.identity import ModelResolver

#: Files the key may read whole: config.json and weight indexes.
_SMALL_LIMITS = {CONFIG_NAME: CONFIG_MAX_BYTES,
                 **{name: INDEX_MAX_BYTES for name, is_index in WEIGHT_LAYOUTS if is_index}}
#: What a weight file can be called (the layouts' files and the shards indexes name): hashed only when needed.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".index.json")


def layouts_for(sdk: str | None) -> tuple[tuple[str, bool], ...]:
    """The weight-file order of the NxDI that release ``sdk`` ships (the newest order when unknown)."""
    if sdk is None:
        return WEIGHT_LAYOUTS
    try:
        return weight_layouts(neuron_releases.lookup(sdk).neuronx_distributed_inference)
    except neuron_releases.UnknownRelease:
        return WEIGHT_LAYOUTS


def verify_digests(material: CheckpointMaterial, config_sha256: str) -> dict[str, str]:
    """What the worker checks on the directory it hands the compile (``fetch["verify"]``: relative path ->
    sha256): config.json's bytes as the key read them, and the weight files when the key holds them."""
    return {CONFIG_NAME: config_sha256, **(material.weights or {})}


def check_total_size(total: int, where: str, max_bytes: int) -> None:
    """A ModelRefError when a checkpoint pinned file by file is larger than the worker may fetch: the same cap
    an archive's extraction has (``COMPILESVC_HF_EXTRACT_MAX_BYTES``)."""
    if total > max_bytes:
        raise ModelRefError(f"{where} holds {total} bytes, more than {max_bytes} "
                            "(COMPILESVC_HF_EXTRACT_MAX_BYTES), the most a worker fetches for one checkpoint")


def listing_sha256(entries: Iterable[Iterable[Any]]) -> str:
    """The model sha256 of a directory pinned file by file: a digest over its sorted pinned entries (each a list
    such as ``[path, version id, etag, size]``), so another version of any file is another sha256."""
    return digest({"checkpoint-files": sorted([list(entry) for entry in entries])})


def safe_relative(path: str, where: str) -> str:
    """``path`` as a checkpoint-relative POSIX path, or a ModelRefError: never absolute, never ``..``."""
    parts = PurePosixPath(path).parts
    if not parts or path.startswith("/") or any(part in ("..", ".") for part in path.split("/")) or "" in \
            path.split("/"):
        raise ModelRefError(f"{where}: {path!r} is not a plain relative path inside the checkpoint")
    return path


def material_of(names: Iterable[str], read_small: Callable[[str], bytes],
                weight_sha256: Callable[[str], str] | None,
                layouts: tuple[tuple[str, bool], ...] = WEIGHT_LAYOUTS) -> tuple[CheckpointMaterial, str]:
    """The checkpoint's key material from its file ``names`` (relative to its root): config.json parsed, and the
    weight files' digests when ``weight_sha256`` is given (the files NxDI with loader order ``layouts`` reads);
    and config.json's sha256. Refusals (a missing config.json or weights, an index naming absent shards) are
    ModelRefErrors."""
    try:
        files = checkpoint_files(names, read_small, layouts)
        config_bytes = read_small(CONFIG_NAME)
        config = parse_config(config_bytes, CONFIG_NAME)
    except CheckpointError as exc:
        raise ModelRefError(f"not a checkpoint NxD Inference can compile: {exc}") from None
    weights = None if weight_sha256 is None else {name: weight_sha256(name) for name in files}
    return CheckpointMaterial(config, weights), hashlib.sha256(config_bytes).hexdigest()


def _hash_stream(read: Callable[[int], bytes]) -> str:
    hasher = hashlib.sha256()
    while chunk := read(CHUNK_SIZE):
        hasher.update(chunk)
    return hasher.hexdigest()


# -- blob: a tar archive in the store -------------------------------------------------------------------------


def _archive_root(names: Iterable[str]) -> str:
    """The archive's checkpoint root ("" or "top/"), as the worker's extraction finds it: config.json at the root,
    else in its single top-level directory (workers.compiling.archive_limits.safe_extract)."""
    names = set(names)
    if CONFIG_NAME in names:
        return ""
    tops = {name.split("/", 1)[0] for name in names}
    if len(tops) == 1 and f"{next(iter(tops))}/{CONFIG_NAME}" in names:
        return f"{next(iter(tops))}/"
    raise ModelRefError("not a checkpoint NxD Inference can compile: the archive has no config.json at its root or "
                        "in its single top-level directory")


def pin_blob(resolver: ModelResolver, ref: ModelRef, sha256: str, size: int, *, weight_digests: bool,
             layouts: tuple[tuple[str, bool], ...] = WEIGHT_LAYOUTS) -> PinnedModel:
    """An uploaded checkpoint archive, its reading remembered in the ledger by the blob's sha256 and the weight
    layouts it was read with (a blob never changes): the second pin reads nothing from the store, unless it needs
    weight digests the first did not compute."""
    remembered = _remembered(resolver, sha256, layouts)
    if remembered is not None and (remembered[0].weights is not None or not weight_digests):
        material, config_sha256 = remembered
        if not weight_digests:
            material = CheckpointMaterial(material.config, None)
        fetch = {"kind": "blob", "sha256": sha256, "verify": verify_digests(material, config_sha256)}
        return PinnedModel(ref.uri, ref.format, sha256, size, fetch, material)
    pinned = _read_blob(resolver, ref, sha256, size, weight_digests=weight_digests, layouts=layouts)
    if pinned.checkpoint is not None:
        _remember(resolver, sha256, layouts, pinned.checkpoint, pinned.fetch["verify"][CONFIG_NAME])
    return pinned


def _layouts_tag(layouts: tuple[tuple[str, bool], ...]) -> list[str]:
    return [name for name, _ in layouts]


def _remembered(resolver: ModelResolver, sha256: str,
                layouts: tuple[tuple[str, bool], ...]) -> tuple[CheckpointMaterial, str] | None:
    if resolver.sessions is None:
        return None
    with resolver.sessions() as session:
        row = session.get(CheckpointPin, sha256)
        document = dict(row.material) if row is not None else None
    # Read with other weight layouts (another NxDI release's), the weight files may differ: read it again.
    if document is None or document.get("layouts") != _layouts_tag(layouts) or not document.get("config_sha256"):
        return None
    return CheckpointMaterial.from_json(document), str(document["config_sha256"])


def _remember(resolver: ModelResolver, sha256: str, layouts: tuple[tuple[str, bool], ...],
              material: CheckpointMaterial, config_sha256: str) -> None:
    """Store it, or replace one stored without weight digests or with other layouts; a concurrent first pin of the
    same blob wins (the same blob, the same reading)."""
    if resolver.sessions is None:
        return
    document = {**material.as_json(), "config_sha256": config_sha256, "layouts": _layouts_tag(layouts)}
    try:
        with transaction(resolver.sessions) as session:
            row = session.get(CheckpointPin, sha256)
            if row is None:
                session.add(CheckpointPin(blob_sha256=sha256, material=document))
            elif material.weights is not None or dict(row.material).get("layouts") != document["layouts"]:
                row.material = document
    except IntegrityError:
        pass


#: Where an uncompressed tar's first header says so (ustar, GNU and pax headers alike).
_TAR_MAGIC_AT, _TAR_MAGIC = 257, b"ustar"


@contextmanager
def _archive(resolver: ModelResolver, sha256: str, *, ranged: bool) -> Iterator[tuple[tarfile.TarFile, bool]]:
    """The stored archive as a TarFile, and whether it seeks. ``ranged``: an uncompressed tar is opened over ranged
    reads of the store (``"r:"``: each header read, member data skipped), so reading its headers and config.json
    costs a few small requests, not the archive. Otherwise a seekable blob (the local store's file) is read header
    by header, and a stream is read through (tarfile cannot skip without seeking; a compressed archive has no
    offsets to seek to)."""
    store = resolver.store
    assert store is not None
    try:
        if ranged and store.read_blob_range(sha256, _TAR_MAGIC_AT, len(_TAR_MAGIC)) == _TAR_MAGIC:
            with store.open_blob_ranged(sha256) as blob, open_capped(fileobj=blob, mode="r:") as tar:
                yield tar, True
            return
        with store.open_blob(sha256) as blob:
            seekable = _seekable(blob)
            with open_capped(fileobj=blob, mode="r:*" if seekable else "r|*") as tar:
                yield tar, seekable
    except CheckpointError as exc:
        raise ModelRefError(f"not a checkpoint NxD Inference can compile: {exc}") from None
    except ArchiveHeaderTooLarge as exc:  # before any payload past the cap was read (compilesvc.store.tar_caps)
        raise ModelRefError(f"blob sha256:{sha256} is refused: {exc} (archive header cap: {exc.cap})") from None
    except tarfile.TarError as exc:
        raise ModelRefError(f"blob sha256:{sha256} is not a readable tar archive of a checkpoint directory: "
                            f"{exc}") from None
    except OSError as exc:  # a ranged read that came back short: the store changed under us or misbehaves
        raise StoreError(f"reading blob sha256:{sha256}: {exc}") from None


def _members(tar: tarfile.TarFile, max_files: int) -> Iterator[tuple[tarfile.TarInfo, str]]:
    """Each regular member of the archive with its normalised path, the archive refused (a CheckpointError
    naming the member) at a link, a device, a path outside it or a second copy of a path: the worker's extraction
    refuses the same members, so the files the key reads are the files the compile reads."""
    seen: set[str] = set()
    count = 0
    for member in tar:
        count += 1
        if count > max_files:
            raise ModelRefError(f"the checkpoint archive has more than {max_files} files, the most this "
                                "service reads (COMPILESVC_HF_EXTRACT_MAX_FILES)")
        path = archive_member_path(member.name, regular=member.isfile(), directory=member.isdir())
        if path is None:
            continue
        add_member(seen, path, member.name)
        yield member, path


def _wanted(sizes: dict[str, int], layouts: tuple[tuple[str, bool], ...]) -> tuple[str, list[str], set[str]]:
    """The archive's checkpoint root, the names under it, and the members read whole (the root's config.json and
    the index NxDI reads), refused when larger than they may be."""
    root = _archive_root(sizes)
    names = [name[len(root):] for name in sizes if name.startswith(root)]
    try:
        layout, is_index = weight_layout(names, layouts)
    except CheckpointError as exc:
        raise ModelRefError(f"not a checkpoint NxD Inference can compile: {exc}") from None
    wanted = {root + CONFIG_NAME, *([root + layout] if is_index else [])}
    for path in wanted:
        limit = _SMALL_LIMITS[path.rsplit("/", 1)[-1]]
        if sizes[path] > limit:
            raise ModelRefError(f"not a checkpoint NxD Inference can compile: {path} in the archive is larger than "
                                f"{limit // 1024**2} MiB")
    return root, names, wanted


def _read_blob(resolver: ModelResolver, ref: ModelRef, sha256: str, size: int, *, weight_digests: bool,
               layouts: tuple[tuple[str, bool], ...] = WEIGHT_LAYOUTS) -> PinnedModel:
    """An uploaded checkpoint archive: its member list (refusing what the worker's extraction refuses), then the
    root's config.json and the index NxDI reads (nothing else is held: a few MiB, not one copy per directory),
    each root weight member hashed only when ``weight_digests``. A seekable archive is read once, header by header,
    the members wanted read by their offsets (over ranged reads of the store when no weights are hashed: the
    weights would be read whole anyway); a stream is read twice, the weights hashed as they stream past."""
    max_files = resolver.settings.hf_extract_max_files
    small: dict[str, bytes] = {}
    hashed: dict[str, str] = {}

    def take(tar: tarfile.TarFile, member: tarfile.TarInfo, path: str) -> None:
        data = None  # a streamed member can be read once: its bytes, when kept, are hashed
        if path in wanted:
            small[path] = data = _member(tar, member).read()
        if weight_digests and path.startswith(root) and path.endswith(_WEIGHT_SUFFIXES):
            hashed[path] = (hashlib.sha256(data).hexdigest() if data is not None
                            else _hash_stream(_member(tar, member).read))

    with _archive(resolver, sha256, ranged=not weight_digests) as (tar, seekable):
        members = list(_members(tar, max_files))
        root, names, wanted = _wanted({path: member.size for member, path in members}, layouts)
        if seekable:
            for member, path in members:
                take(tar, member, path)
    if not seekable:
        with _archive(resolver, sha256, ranged=False) as (tar, _):
            for member, path in _members(tar, max_files):
                take(tar, member, path)
    material, config_sha256 = material_of(names, lambda name: small[root + name],
                                          (lambda name: hashed[root + name]) if weight_digests else None, layouts)
    fetch = {"kind": "blob", "sha256": sha256, "verify": verify_digests(material, config_sha256)}
    return PinnedModel(ref.uri, ref.format, sha256, size, fetch, material)


def _seekable(blob: IO[bytes]) -> bool:
    try:
        return bool(blob.seekable())
    except (AttributeError, OSError):
        return False


def _member(tar: tarfile.TarFile, member: tarfile.TarInfo) -> IO[bytes]:
    extracted = tar.extractfile(member)
    assert extracted is not None  # a regular file
    return extracted


# -- file:///abs/dir -------------------------------------------------------------------------------------------


def pin_directory(resolver: ModelResolver, ref: ModelRef, root: Path, *, weight_digests: bool,
                  layouts: tuple[tuple[str, bool], ...] = WEIGHT_LAYOUTS) -> PinnedModel:
    """A checkpoint directory on this host: every regular file pinned by (path, size, mtime), config.json read,
    weight files hashed only when ``weight_digests``. Symbolic links are followed (a Hugging Face cache snapshot
    is links into its blobs) and pinned as the files they reach."""
    max_files = resolver.settings.hf_extract_max_files
    files: dict[str, tuple[int, int]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for filename in sorted(filenames):
            path = Path(dirpath) / filename
            try:
                st = os.stat(path)
            except OSError:
                continue  # a dangling link: not a file of the checkpoint
            if not stat.S_ISREG(st.st_mode):
                continue
            if len(files) >= max_files:
                raise ModelRefError(f"{root} has more than {max_files} files, the most this service reads "
                                    "(COMPILESVC_HF_EXTRACT_MAX_FILES)")
            files[path.relative_to(root).as_posix()] = (st.st_size, st.st_mtime_ns)
    check_total_size(sum(size for size, _ in files.values()), str(root), resolver.settings.hf_extract_max_bytes)

    def read_small(name: str) -> bytes:
        limit = _SMALL_LIMITS.get(name.rsplit("/", 1)[-1], CONFIG_MAX_BYTES)
        with open(root / name, "rb") as fh:
            data = fh.read(limit + 1)
        if len(data) > limit:
            raise ModelRefError(f"not a checkpoint NxD Inference can compile: {root / name} is larger than "
                                f"{limit // 1024**2} MiB")
        return data

    def weight_sha256(name: str) -> str:
        with open(root / name, "rb") as fh:
            sha = _hash_stream(fh.read)
        if (os.stat(root / name).st_size, os.stat(root / name).st_mtime_ns) != files[name]:
            raise ModelChangedError(f"{root / name} changed while it was being read; retry once writes to it stop")
        return sha

    try:
        material, config_sha256 = material_of(files, read_small, weight_sha256 if weight_digests else None, layouts)
    except OSError as exc:
        raise ModelRefError(f"cannot read the checkpoint in {root}: {exc.strerror}") from None
    listed = [[name, size, mtime_ns] for name, (size, mtime_ns) in files.items()]
    sha256 = listing_sha256(listed)
    fetch = {"kind": "file-dir", "path": str(root), "sha256": sha256,
             "files": [{"path": name, "size": size, "mtime_ns": mtime_ns} for name, size, mtime_ns in listed],
             "verify": verify_digests(material, config_sha256)}
    return PinnedModel(ref.uri, ref.format, sha256, sum(size for size, _ in files.values()), fetch, material)


def fetch_directory(fetch: dict[str, Any], dest: Path) -> None:
    """The worker's copy of a pinned checkpoint directory at ``dest``: each file copied, and checked to be the
    one pinned (size and mtime, before and after the copy); :class:`ModelChangedError` otherwise."""
    root = Path(str(fetch["path"]))
    for entry in fetch["files"]:
        name = safe_relative(str(entry["path"]), "model.uri")
        pinned = (int(entry["size"]), int(entry["mtime_ns"]))
        source, target = root / name, dest / name
        changed = ModelChangedError(f"{source} changed since it was pinned (size or mtime differ); resubmit the "
                                    "build to pin it again")
        try:
            before = os.stat(source)
        except FileNotFoundError:
            raise changed from None
        if (before.st_size, before.st_mtime_ns) != pinned:
            raise changed
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        with open(source, "rb") as src, open(partial, "wb") as out:
            while chunk := src.read(CHUNK_SIZE):
                out.write(chunk)
        after = os.stat(source)
        if (after.st_size, after.st_mtime_ns) != pinned or partial.stat().st_size != pinned[0]:
            partial.unlink()
            raise changed
        partial.replace(target)


# -- what NxDI's model hub has ---------------------------------------------------------------------------------


def check_architecture(sdk: str, material: CheckpointMaterial) -> None:
    """A ModelRefError on ``model`` when the NxDI release ``sdk`` ships has no model class for the checkpoint's
    architectures (the architecture hub: ``compilesvc.spec.nxdi_models.architecture_class``)."""
    try:
        nxdi_models.check_checkpoint_config(sdk, material.config)
    except nxdi_models.UnsupportedArchitecture as exc:
        raise ModelRefError(str(exc), field="model") from None
    except nxdi_models.CheckpointConfigError as exc:
        raise ModelRefError(f"config.json: {exc.message}", field="model") from None
