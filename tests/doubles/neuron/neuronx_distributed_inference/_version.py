"""TEST DOUBLE: the real file holds ``__version__ = "<major>.<minor>.0"`` (NXDI@ef2731e
src/neuronx_distributed_inference/_version.py:L3 "0.9.0"; v0.7.14366: "0.7.0"); pip's metadata has the full one."""

from _release import current

_parts = (current().nxdi or "0.0.0").split(".")
__version__ = f"{_parts[0]}.{_parts[1]}.0"
