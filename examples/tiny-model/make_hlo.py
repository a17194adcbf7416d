"""Regenerate ``compilesvc/demo/tiny.hlo.pb``, the HLO module ``compilesvc doctor`` compiles with neuronx-cc.

A serialized XLA ``HloModuleProto`` of ``tanh(x @ w) + 1`` (x: f32[1,16], w: f32[16,16]), lowered by JAX
(0.10.2 made the shipped file) because neither torch-xla nor the Neuron SDK installs here::

    python -m venv /tmp/jax && /tmp/jax/bin/pip install jax && /tmp/jax/bin/python examples/tiny-model/make_hlo.py
"""

from pathlib import Path

import jax
import jax.numpy as jnp


def main() -> None:
    def f(x: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.tanh(x @ w) + 1.0

    lowered = jax.jit(f).lower(jnp.ones((1, 16), jnp.float32), jnp.ones((16, 16), jnp.float32))
    proto = lowered.compiler_ir("hlo").as_serialized_hlo_module_proto()
    out = Path(__file__).resolve().parents[2] / "compilesvc" / "demo" / "tiny.hlo.pb"
    out.write_bytes(proto)
    print(f"wrote {out} ({len(proto)} bytes)")


if __name__ == "__main__":
    main()
