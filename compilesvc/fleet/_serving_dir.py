"""A serving directory: an NxD Inference artifact without weights, made loadable next to its checkpoint.

vLLM constructs NxDI's model from ``NEURON_COMPILED_ARTIFACTS`` alone (upstreaming-to-vllm@dd417b3
vllm/model_executor/model_loader/neuronx_distributed.py:L182; vllm-project/vllm-neuron@a5ef7c8
vllm_neuron/worker/neuronx_distributed_model_loader.py:L216), so NxDI's ``model_path`` is the compiled directory,
and a shard-on-load artifact reads the HF weights from ``_name_or_path`` when that exists on the host, else from
the compiled directory itself (NXDI@ef2731e models/application_base.py:L630-L635) — never from vLLM's ``--model``.
The cached directory is read-only and holds no checkpoint, so ``serve-env --checkpoint CKPT --serving-dir DIR``
makes DIR: symbolic links to the cached compiled files and to the checkpoint's files, side by side, which is the
one place NxDI will look. DIR is the user's: it must be absent, empty, or an earlier serving directory (its
marker file says so), and it appears whole in one rename.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path

from compilesvc.fleet._llm import LLMArtifact
from compilesvc.fleet._remote import FleetError
from compilesvc.spec.checkpoint import WEIGHT_FILES

MARKER = ".compilesvc-serving.json"
#: What NxDI accepts as an HF checkpoint directory, in its order (NXDI@ef2731e modules/checkpoint.py:L49-L64): the
#: list pinning keys the weights by, so the serving host and the key agree on which file is read.
CHECKPOINT_FILES = WEIGHT_FILES


class ServingDirRefused(FleetError):
    """The serving directory cannot be made there (a file of the user's is in the way, or no checkpoint)."""


def is_checkpoint(path: Path) -> bool:
    """A directory NxDI's ``load_state_dict`` reads weights from (config.json beside it, as transformers writes)."""
    return path.is_dir() and (path / "config.json").is_file() and checkpoint_file(path) is not None


def checkpoint_file(path: Path) -> Path | None:
    """The file NxDI's ``load_state_dict(path)`` would read first, if any."""
    return next((path / n for n in CHECKPOINT_FILES if (path / n).is_file()), None)


def make_serving_dir(artifact: LLMArtifact, checkpoint: Path, into: Path) -> LLMArtifact:
    """``into``: links to ``artifact``'s compiled files and ``checkpoint``'s top-level files (the compiled
    files win a name clash); returns the artifact as seen from there."""
    checkpoint = Path(os.path.abspath(checkpoint))
    into = Path(os.path.abspath(into))
    if not is_checkpoint(checkpoint):
        raise ServingDirRefused(f"{checkpoint} is not a checkpoint directory (config.json and one of "
                                f"{', '.join(CHECKPOINT_FILES)})")
    replace = _check_target(into)
    staging = into.parent / f".{into.name}.{uuid.uuid4().hex[:8]}.staging"
    try:
        staging.mkdir(parents=True)
        for name in artifact.files:
            _link(artifact.directory / name, staging / name)
        for entry in sorted(checkpoint.iterdir()):
            if entry.is_file() and entry.name not in artifact.files:
                _link(entry, staging / entry.name)
        marker = {"key": artifact.key, "compiled": str(artifact.directory), "checkpoint": str(checkpoint)}
        (staging / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        if replace:
            aside = into.parent / f".{into.name}.{uuid.uuid4().hex[:8]}.old"
            into.rename(aside)
            shutil.rmtree(aside, ignore_errors=True)
        elif into.exists():
            into.rmdir()  # empty (checked): the rename needs it gone
        staging.rename(into)
    except OSError as exc:
        raise ServingDirRefused(f"cannot make the serving directory {into}: {exc.strerror or exc}") from None
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return LLMArtifact(artifact.key, into, artifact.config, tuple(sorted(
        p.relative_to(into).as_posix() for p in into.rglob("*") if p.is_symlink() or p.is_file())))


def _check_target(into: Path) -> bool:
    """True: ``into`` is an earlier serving directory, to be replaced; False: absent or empty."""
    if not into.exists():
        return False
    if not into.is_dir():
        raise ServingDirRefused(f"{into} is a file; the serving directory must be absent, empty, or an earlier one")
    entries = list(into.iterdir())
    if not entries:
        return False
    if not (into / MARKER).is_file():
        raise ServingDirRefused(f"{into} is not empty and not an earlier serving directory (no {MARKER}); "
                                "choose another --serving-dir")
    for path in into.rglob("*"):
        if not (path.is_symlink() or path.is_dir() or path.name == MARKER):
            raise ServingDirRefused(f"{into} holds {path.relative_to(into)}, which serve-env did not make; "
                                    "leaving it alone")
    return True


def _link(target: Path, link: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        link.unlink()
    link.symlink_to(target)
