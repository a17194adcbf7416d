"""A Hugging Face checkpoint directory as the tar archive an ``hf-checkpoint`` ``blob:`` model is, made
deterministically so the same checkpoint is the same ``blob:sha256:`` on every machine (uploads are content
addressed: a second upload of it is free, and the service's pins and keys agree).

The archive is what the service reads (``compilesvc.pinning.checkpoints.pin_blob``) and the worker extracts
(``workers.compiling.archive_limits.safe_extract``): the files at the archive's root, ``config.json`` first (a
reader that streams the archive meets the key's input before any weights), then every other file in sorted
order. Only regular files are archived, each with the same header fields wherever it is made: mtime 0, uid/gid 0,
no user or group names, mode 0644 (the worker's ``data`` filter normalises modes anyway), and no pax timestamps
(POSIX.1-2001 headers carry only what ustar cannot: long names, sizes over 8 GiB).

A symbolic link inside the directory is archived as the file it reaches; a link leaving the directory, a
dangling link, a link loop and a special file (FIFO, socket, device) are refused (:class:`ArchiveRefused`): the
archive must hold the checkpoint and nothing else from the machine it is made on. Standard library only (the
client install).
"""

from __future__ import annotations

import os
import stat
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

CONFIG_NAME = "config.json"
_MODE = 0o644


class ArchiveRefused(ValueError):
    """The directory cannot be archived as a checkpoint; the message says which path and why."""


def checkpoint_files(root: Path) -> list[tuple[str, Path]]:
    """The archive's members: (name in the archive, the file to read), ``config.json`` first, then sorted by
    name. Raises :class:`ArchiveRefused` for what must not be archived or a directory without config.json."""
    real_root = Path(os.path.realpath(root))
    if not real_root.is_dir():
        raise ArchiveRefused(f"{root} is not a directory")
    found = dict(_walk(root, real_root, "", (real_root,)))
    if CONFIG_NAME not in found:
        raise ArchiveRefused(f"{root} has no {CONFIG_NAME}: a Hugging Face checkpoint directory holds its "
                             f"{CONFIG_NAME} and weights at its top level")
    return [(CONFIG_NAME, found[CONFIG_NAME]), *sorted((n, p) for n, p in found.items() if n != CONFIG_NAME)]


def _walk(directory: Path, real_root: Path, prefix: str, chain: tuple[Path, ...]) -> Iterator[tuple[str, Path]]:
    """Files under ``directory`` (reached as ``prefix``); ``chain``: the real directories being walked, to
    refuse a link back into one of them (an endless archive)."""
    with os.scandir(directory) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            path, name = Path(entry.path), prefix + entry.name
            if entry.is_symlink():
                target = Path(os.path.realpath(path))
                if target != real_root and real_root not in target.parents:
                    raise ArchiveRefused(f"{path} is a symbolic link leaving the checkpoint directory (to "
                                         f"{os.readlink(path)}); copy the checkpoint with its files in place "
                                         "(cp -rL) and upload the copy")
                if not target.exists():
                    raise ArchiveRefused(f"{path} is a symbolic link to nothing ({os.readlink(path)})")
            try:
                st = os.stat(path)  # through a link: what it reaches
            except OSError as exc:
                raise ArchiveRefused(f"cannot read {path}: {exc.strerror}") from None
            if stat.S_ISDIR(st.st_mode):
                real = Path(os.path.realpath(path))
                if real in chain:
                    raise ArchiveRefused(f"{path} is a symbolic link to a directory containing it (a loop)")
                yield from _walk(path, real_root, f"{name}/", (*chain, real))
            elif stat.S_ISREG(st.st_mode):
                yield name, path
            else:
                raise ArchiveRefused(f"{path} is not a regular file or directory (a FIFO, socket or device); "
                                     "a checkpoint holds files only")


def write_archive(root: Path, out: BinaryIO) -> int:
    """Write the archive of the checkpoint directory ``root`` to ``out``, streaming each file; returns the
    number of files. :class:`ArchiveRefused` as :func:`checkpoint_files`, and for a file that changes size
    while it is read."""
    members = checkpoint_files(root)
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT, encoding="utf-8") as tar:
        for name, path in members:
            with open(path, "rb") as source:
                info = tarfile.TarInfo(name)
                info.size = os.fstat(source.fileno()).st_size
                info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = 0, _MODE, 0, 0, "", ""
                try:
                    tar.addfile(info, source)
                except OSError as exc:  # tarfile's "unexpected end of data": the file shrank under us
                    raise ArchiveRefused(f"{path} changed while it was archived ({exc}); upload again once "
                                         "writes to it stop") from None
    return len(members)
