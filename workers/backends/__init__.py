"""Compiler backends, and the compile child that runs one of them: one class per ``compiler.backend`` value,
behind the contract in :mod:`workers.compiling.contract`.

``torchscript`` and ``aotinductor`` (:mod:`.cpu`) serve the cpu target with the worker's torch; ``trace``
and ``neuronx-cc`` (:mod:`.neuron`) serve inf2/trn1/trn2 with the Neuron SDK; ``nxdi`` (:mod:`.nxdi`) compiles a
Hugging Face checkpoint with NxD Inference. :func:`backend_class` imports
a backend's module only when asked for it, so importing this package needs neither torch nor the SDK.

May import the core, :mod:`workers.compiling` (the contract, model loading, classification),
:mod:`workers.isolation`'s environment allow-list and :mod:`workers.host.versions`.
"""

from __future__ import annotations

import importlib

from workers.compiling.contract import Backend

#: backend name -> "module:Class". Imported lazily: the cpu backends import torch at module level, and the
#: neuron ones must load on hosts without torch for the hlo path.
BACKENDS: dict[str, str] = {
    "torchscript": "workers.backends.cpu:TorchScriptBackend",
    "aotinductor": "workers.backends.cpu:AOTInductorBackend",
    "trace": "workers.backends.neuron:TraceBackend",
    "neuronx-cc": "workers.backends.neuron:NeuronxCcBackend",
    "nxdi": "workers.backends.nxdi:NxdiBackend",
}


def backend_class(name: str) -> type[Backend]:
    """The backend class registered under ``name`` (KeyError if none)."""
    module_name, _, class_name = BACKENDS[name].partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(cls, type) and issubclass(cls, Backend)):  # a registry typo should fail loudly
        raise TypeError(f"{BACKENDS[name]} is not a Backend")
    return cls
