"""The NeuronConfig field table of each NxD Inference (NxDI) release: names, types and defaults, as data.

Owns ``compilesvc/spec/nxdi_fields.json`` and its look-ups. The table is every ``kwargs.pop(name, default)``
of ``src/neuronx_distributed_inference/models/config.py`` at the ref of github.com/aws-neuron/
neuronx-distributed-inference holding each release's source (docs/research/nxdi_config_fields.md, made
with Python's ast; each default keeps its line there, so a message can cite ``<ref> config.py:L<n>``), and
every ``assert``/``raise`` of config.py per release with its line (the "checks" part; :func:`nxdi_check` cites
one). :class:`NeuronConfigError`, the refusal of one field, lives here so that the modules checking a
NeuronConfig (:mod:`nxdi_config`, :mod:`nxdi_buckets`) share it without importing each other.
The types are read from how config.py uses a field (a ``None`` default does not say it).

Which column a Neuron SDK release uses is decided by the NxDI version it ships (:mod:`neuron_releases`,
from the SDK's manifest; docs/research/nxdi.md §0). Two NxDI versions have no source on GitHub: 0.7.15063
(SDK 2.27.1; only 0.7.14366 is tagged) and 0.10.x (SDK 2.30/2.31): they are marked ``assumed`` and use the
nearest older source until checked against the wheel.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

from compilesvc.spec.neuron_kinds import NotShipped, require_kind
from compilesvc.spec.neuron_releases import lookup

TABLE_FORMAT = "compilesvc-nxdi-fields/1"
REPO = "aws-neuron/neuronx-distributed-inference"
CONFIG_PATH = "src/neuronx_distributed_inference/models/config.py"

#: NxDI version (as the SDK manifest names it) -> (the table's column, why it is assumed or None).
#: 0.9.17334 (SDK 2.29.0 and 2.29.1) reads ef2731e "sync code base to release-2.29-v2", the later of the two
#: 2.29 commits (c63afe0 "Release 2.29 (#16)" is the other; their field tables agree).
_COLUMNS: dict[str, tuple[str, str | None]] = {
    "0.1.0": ("2.21.0", None),
    "0.1.1": ("2.21.1", None),
    "0.2.0": ("2.22", None),
    "0.3.5591": ("2.23", None),
    "0.4.7422": ("2.24", None),
    "0.5.9230": ("2.25", None),
    "0.6.10598": ("2.26", None),
    "0.7.14366": ("2.27.0", None),
    "0.7.15063": ("2.27.0", "assumed = NxDI 0.7.14366 source: 0.7.15063 has no tag or commit on GitHub"),
    "0.8.16251": ("2.28", None),
    "0.9.17334": ("2.29-v2", None),
    "0.10.17970": ("2.29-v2", "assumed = 2.29 source: NxDI 0.10.x is not on GitHub"),
    "0.10.18399": ("2.29-v2", "assumed = 2.29 source: NxDI 0.10.x is not on GitHub"),
}
#: The configuration classes whose fields a spec may set: NeuronConfig and its subclasses (top level) and the
#: nested configs NeuronConfig builds from a dict (``on_device_sampling_config`` -> OnDeviceSamplingConfig, …).
TOP_CLASSES = ("NeuronConfig", "MoENeuronConfig", "MultimodalVisionNeuronConfig")


@dataclass(frozen=True)
class Field:
    """One field of one class in one release."""

    cls: str
    name: str
    #: "int", "bool", "number", "str", "dtype", "int_list", "str_list", "list", "object[:Class]", "any"; "|null"
    type: str
    default: dict[str, Any]  # {"value": v} | {"from": other_field} | {"expr": source text}, and "line"

    @property
    def nullable(self) -> bool:
        return "null" in self.type.split("|")

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(part for part in self.type.split("|") if part != "null")

    @property
    def nested(self) -> str | None:
        """The class a dict value of this field is built into (``object:OnDeviceSamplingConfig``), or None."""
        for kind in self.kinds:
            if kind.startswith("object:"):
                return kind.split(":", 1)[1]
        return None


@dataclass(frozen=True)
class NxdiRelease:
    """The NxDI a Neuron SDK release ships and the source its table was read from."""

    sdk: str
    version: str
    column: str
    ref: str
    assumed: str | None

    def check_line(self, fragment: str) -> int | None:
        """The line of the ``assert``/``raise`` in this release's config.py whose text holds ``fragment``, or None
        when this release does not make that check (the "checks" part of the table, per release)."""
        for line, _cls, _kind, text in _document()["checks"].get(self.column, ()):
            if fragment in text:
                return int(line)
        return None

    def cite(self, line: int | None = None) -> str:
        """``aws-neuron/neuronx-distributed-inference@<ref> …/config.py:L<n>`` (with the assumption, if any)."""
        where = f"{REPO}@{self.ref} {CONFIG_PATH}" + (f":L{line}" if line else "")
        return f"{where} ({self.assumed})" if self.assumed else where


class NeuronConfigError(ValueError):
    """A neuron_config field NxDI would refuse or ignore; ``field`` is its path inside neuron_config."""

    def __init__(self, field: tuple[str | int, ...], message: str):
        super().__init__(message)
        self.field = field
        self.message = message


def nxdi_check(rel: NxdiRelease, fragment: str) -> str | None:
    """Where ``rel``'s NxDI makes the check whose message holds ``fragment`` (None: it does not)."""
    line = rel.check_line(fragment)
    return rel.cite(line) if line is not None else None


@functools.lru_cache(maxsize=1)
def _document() -> dict[str, Any]:
    path = resources.files("compilesvc.spec").joinpath("nxdi_fields.json")
    document: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    if document.get("format") != TABLE_FORMAT:
        raise RuntimeError(f"{path} is not a {TABLE_FORMAT} document")
    return document


def nxdi_release(sdk: str) -> NxdiRelease:
    """The NxDI of ``sdk``: :class:`NotShipped` for a release without it (2.32.0, before 2.21.0),
    :class:`~compilesvc.spec.neuron_releases.UnknownRelease` for one the release table does not list."""
    require_kind(sdk, "nxdi", 1)
    version = lookup(sdk).neuronx_distributed_inference
    assert version is not None  # require_kind checked it
    if version in _COLUMNS:
        column, assumed = _COLUMNS[version]
    else:  # a newer NxDI than the table knows: the newest source we have, said to be assumed
        column, assumed = "2.29-v2", f"assumed = 2.29 source: NxDI {version} is newer than this table"
    return NxdiRelease(sdk=sdk, version=version, column=column, ref=_document()["columns"][column], assumed=assumed)


def fields(sdk: str, cls: str) -> dict[str, Field]:
    """The fields of ``cls`` in ``sdk``'s NxDI, in config.py's order (empty if the class does not exist there)."""
    return _fields(nxdi_release(sdk).column, cls)


@functools.lru_cache(maxsize=128)
def _fields(column: str, cls: str) -> dict[str, Field]:
    table = _document()["classes"].get(cls, {})
    return {name: Field(cls, name, row["type"], row["defaults"][column])
            for name, row in table.items() if column in row["defaults"]}


def releases_with(cls: str, name: str) -> list[str]:
    """The SDK releases whose NxDI has ``cls.name`` (for "exists from …" in a refusal)."""
    from compilesvc.spec.neuron_releases import table

    out = []
    for label, entry in table().items():
        if entry.neuronx_distributed_inference is None:
            continue
        try:
            if name in fields(label, cls):
                out.append(label)
        except NotShipped:  # pragma: no cover - entries without NxDI were skipped
            continue
    return out
