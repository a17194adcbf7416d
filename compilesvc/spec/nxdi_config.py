"""NxD Inference's NeuronConfig, as a spec gives it: checked field by field against the NxDI release the spec's SDK
release ships, and written out canonically (every default filled in) for the key.

(Interface first; the per-release field table follows.)
"""

from __future__ import annotations

from typing import Any


class NeuronConfigError(ValueError):
    """A neuron_config field NxDI would refuse or ignore; ``field`` is its path inside neuron_config."""

    def __init__(self, field: tuple[str | int, ...], message: str):
        super().__init__(message)
        self.field = field
        self.message = message


def canonical_neuron_config(sdk: str, target: str, raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` checked against ``sdk``'s NxDI release for ``target`` and completed with its defaults.

    Raises :class:`NeuronConfigError` naming the first bad field.
    """
    return dict(sorted(raw.items()))
