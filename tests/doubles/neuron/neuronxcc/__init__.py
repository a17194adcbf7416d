"""TEST DOUBLE of the ``neuronxcc`` package (the AWS Neuron compiler's Python package). Not the real SDK.

A stand-in for tests because the real neuronx-cc cannot be installed on the test hosts; only
``__version__`` is provided. The command-line double is tests/doubles/neuron/bin/neuronx-cc.
"""

__version__ = "0.0.0.0+testdouble"
