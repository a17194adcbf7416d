"""The compile spec and what is derived from it: the spec model and its parsing, compiler flags and the
Neuron option and release tables they are checked against, artifact keys, and manifests.

Imports only the standard library, pydantic and :mod:`compilesvc.states`-level modules: the CLI client and
the fleet library use it without the ledger. ``compilesvc.spec.CompileSpec`` is public (docs and users name it).
"""

from compilesvc.spec.compile_spec import CompileSpec

__all__ = ["CompileSpec"]
