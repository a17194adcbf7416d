"""TEST DOUBLE of ``neuronx_distributed._version``. Not the real SDK.

The real package keeps its version here, not in ``__init__`` (src/neuronx_distributed/_version.py, e.g.
``__version__ = "0.18.0"`` in the 2.29 release), and it holds only major.minor.0: setup.py's
``get_version`` adds the build number and a hash to the *distribution's* version (``0.18.27753+…``),
which ``importlib.metadata`` would report on a real host (the double installs no metadata).
"""

from _release import current

_major, _minor, *_rest = current().neuronx_distributed.split(".")
__version__ = f"{_major}.{_minor}.0"
