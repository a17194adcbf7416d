"""TEST DOUBLE of the ``neuronxcc`` package (the AWS Neuron compiler's Python package). Not the real SDK.

A stand-in for tests because the real neuronx-cc cannot be installed on the test hosts; only
``__version__`` is provided, for the emulated release (tests/doubles/neuron/_release.py), in pip's shape
"2.14.227.0+2d4f85be" (aws-neuron-sdk#948). The command-line double is tests/doubles/neuron/bin/neuronx-cc.
"""

from _release import current

__version__ = f"{current().neuronx_cc}+{current().build_hash}"
