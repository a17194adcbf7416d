"""The transformers version an NxD Inference compile runs with, per NxDI release.

NxDI builds its InferenceConfig from the checkpoint's config.json through transformers' AutoConfig
(``load_pretrained_config``, utils/hf_adapter.py): the defaults transformers' config classes fill (rope
settings, ``rms_norm_eps``, ``pad_token_id``, …) reach the compiled graph. A worker with another transformers
can compile something else under the same key, so the key must imply the transformers version.

It does so without a key field: the key names NxDI's exact version (:func:`compilesvc.spec.neuron_kinds.
toolchain_material`), this table maps that version to one exact transformers version, and a worker whose
installed transformers differs offers no nxdi compile and refuses one (:func:`workers.host.versions.
nxdi_unavailable`), as it does another release's NxDI.

What the sources say: NxDI's ``setup.py`` pins a minor line, ``transformers==4.X.*``, at every tagged release
(aws-neuron/neuronx-distributed-inference: v0.1.0/v0.1.1 ``4.45.*``; v0.2.0 and v0.3.5591 ``4.48.*``;
v0.4.7422, v0.5.9230 and v0.6.10598 ``4.51.*``; v0.7.14366 and branch cherry-pick-r227 (0.7, SDK 2.27.x)
``4.56.*``; cd3abf3 "Neuron SDK Release 2.28.0" (0.8) and c63afe0 "Release 2.29" (0.9) ``4.57.*``). The SDK's
release notes agree where they say anything (release-notes/components/nxd-inference.rst, 2.24: "Upgrade
``transformers`` requirement from v4.48 to v4.51"). NxDI 0.10 (SDK 2.30.0, 2.31.x) has no public source tree;
neither release's notes announce a change of requirement, so 0.10 stays on ``4.57.*`` (inferred, not read).

A minor line is a range (``4.57.0`` … ``4.57.6``), and the key must name what runs: so the table fixes one
exact version per line, the line's last patch release on PyPI (checked 2026-11-26), the one a fresh
``pip install`` of that NxDI release resolves to. Upgrading it is a key change in all but name: add a new
NxDI line, never edit a published one.
"""

from __future__ import annotations

from typing import NamedTuple


class TransformersPin(NamedTuple):
    """NxDI's declared requirement (``requires``) and the exact version compiles of it run with (``exact``)."""

    requires: str
    exact: str
    source: str


#: NxDI major.minor -> its transformers pin (see the module docstring for the sources).
_BY_NXDI_LINE: dict[str, TransformersPin] = {
    "0.1": TransformersPin("4.45.*", "4.45.2", "neuronx-distributed-inference v0.1.0, v0.1.1 setup.py"),
    "0.2": TransformersPin("4.48.*", "4.48.3", "neuronx-distributed-inference v0.2.0 setup.py"),
    "0.3": TransformersPin("4.48.*", "4.48.3", "neuronx-distributed-inference v0.3.5591 setup.py"),
    "0.4": TransformersPin("4.51.*", "4.51.3", "neuronx-distributed-inference v0.4.7422 setup.py"),
    "0.5": TransformersPin("4.51.*", "4.51.3", "neuronx-distributed-inference v0.5.9230 setup.py"),
    "0.6": TransformersPin("4.51.*", "4.51.3", "neuronx-distributed-inference v0.6.10598 setup.py"),
    "0.7": TransformersPin("4.56.*", "4.56.2", "neuronx-distributed-inference v0.7.14366 setup.py"),
    "0.8": TransformersPin("4.57.*", "4.57.6", "neuronx-distributed-inference cd3abf3 (SDK 2.28.0) setup.py"),
    "0.9": TransformersPin("4.57.*", "4.57.6", "neuronx-distributed-inference c63afe0 (SDK 2.29) setup.py"),
    "0.10": TransformersPin("4.57.*", "4.57.6", "inferred: no public 0.10 tree; SDK 2.30/2.31 notes announce "
                                                "no change"),
}


def nxdi_line(nxdi_version: str) -> str:
    """``"0.7.15063"`` -> ``"0.7"``."""
    return ".".join(nxdi_version.split("+")[0].split(".")[:2])


def transformers_pin(nxdi_version: str | None) -> TransformersPin | None:
    """The transformers pin of NxDI ``nxdi_version`` (None: no NxDI, or a line this table does not know)."""
    if not nxdi_version:
        return None
    return _BY_NXDI_LINE.get(nxdi_line(nxdi_version))


def transformers_for(nxdi_version: str | None) -> str | None:
    """The exact transformers version compiles with NxDI ``nxdi_version`` run with (None: unknown)."""
    pin = transformers_pin(nxdi_version)
    return pin.exact if pin else None
