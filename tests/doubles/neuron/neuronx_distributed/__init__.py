"""TEST DOUBLE of ``neuronx_distributed`` (AWS Neuron's tensor-parallel library). Not the real SDK.

A stand-in for tests because the real package cannot be installed on the test hosts; only the trace API
the compile child uses for ``tp_degree > 1`` exists (:mod:`neuronx_distributed.trace`).
"""

__version__ = "0.0.0+testdouble"
