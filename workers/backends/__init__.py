"""Compiler backends: one class per ``compiler.backend`` value, behind the contract in :mod:`.base`.

``torchscript`` and ``aotinductor`` (:mod:`.cpu`) serve the cpu target with the worker's torch; ``trace``
and ``neuronx-cc`` (:mod:`.neuron`) serve inf2/trn1/trn2 with the Neuron SDK. :func:`backend_class` imports
a backend's module only when asked for it, so importing this package needs neither torch nor the SDK.
"""

from workers.compiling.contract import (
    BACKENDS,
    Backend,
    CompileFailure,
    CompileRequest,
    CompileResult,
    InfraError,
    backend_class,
)

__all__ = ["BACKENDS", "Backend", "CompileFailure", "CompileRequest", "CompileResult", "InfraError",
           "backend_class"]
