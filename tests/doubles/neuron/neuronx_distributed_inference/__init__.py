"""TEST DOUBLE of ``neuronx_distributed_inference`` (NxD Inference, AWS Neuron's LLM library). Not the real package.

Built from aws-neuron/neuronx-distributed-inference's source (ef2731e = SDK 2.29, v0.7.14366 = 2.27, and the
other tags in docs/research/nxdi.md §0); each behaviour cites ``repo@ref path:Lx-Ly``. Installed only for a
release whose manifest ships NxDI (``_release.Release.nxdi``; tests/doubles/__init__.py puts it on the path).
What it emulates and its limits: tests/doubles/neuron/README.md.
"""

from _release import current

if current().nxdi is None:  # neuron_double_env leaves the package off the path for such a release
    raise ImportError(f"Neuron TEST DOUBLE: SDK {current().release} ships no neuronx-distributed-inference (test "
                      f"bug: the double's neuronx_distributed_inference is on the path)")
