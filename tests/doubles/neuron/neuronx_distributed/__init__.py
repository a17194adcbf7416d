"""TEST DOUBLE of ``neuronx_distributed`` (AWS Neuron's tensor-parallel library). Not the real SDK.

A stand-in for tests because the real package cannot be installed on the test hosts; only the trace APIs
a compile uses for ``tp_degree > 1`` exist (:mod:`neuronx_distributed.trace`). As in the real package,
``__init__`` has no ``__version__``: it is in :mod:`neuronx_distributed._version` (major.minor.0 of the
emulated release's version, tests/doubles/neuron/_release.py; e.g. 0.16.0 for SDK 2.27.1).
"""
