"""TEST DOUBLE of ``neuronx_distributed`` (AWS Neuron's tensor-parallel library). Not the real SDK.

A stand-in for tests because the real package cannot be installed on the test hosts; only the trace APIs
a compile uses for ``tp_degree > 1`` exist (:mod:`neuronx_distributed.trace`). ``__version__`` is the
emulated release's (tests/doubles/neuron/_release.py), e.g. 0.16.25997 for SDK 2.27.1.
"""

from _release import current

__version__ = current().neuronx_distributed
