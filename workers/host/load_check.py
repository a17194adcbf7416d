"""Load a traced Neuron artifact and run it once: the doctor's last check, in a process of its own.

Usage: ``python -m workers.host.load_check MODEL_PT INPUTS_JSON``

``MODEL_PT`` is what the trace backend saved (``torch.jit.save`` of ``torch_neuronx.trace``'s result: a
TorchScript module with the NEFF inside); ``INPUTS_JSON`` the bucket's inputs as the compile request lists
them (``[{"name", "shape", "dtype"}, ...]``). ``torch_neuronx`` is imported before ``torch.jit.load`` because
it registers the operator that runs the NEFF; on a host with a Neuron device the call runs on a NeuronCore.
Prints one ``[load-check] ok ...`` line and exits 0; anything else exits non-zero with the traceback (the
doctor shows its last lines). Its own process, so a runtime that aborts cannot take the doctor with it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def _shapes(value: Any) -> str:
    """The output's tensor shapes, for the report (tensors, or tuples/lists/dicts of them)."""
    if hasattr(value, "shape"):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_shapes(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(_shapes(v) for v in value) + ")"
    return type(value).__name__


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m workers.host.load_check MODEL_PT INPUTS_JSON", file=sys.stderr)
        return 2
    import torch
    import torch_neuronx  # noqa: F401  (registers the Neuron operator the saved module calls)

    from workers.compiling.contract import InputDesc
    from workers.compiling.model_loading import example_inputs, order_inputs

    inputs = [InputDesc(i["name"], tuple(i["shape"]), i["dtype"]) for i in json.loads(Path(argv[1]).read_text())]
    started = time.monotonic()
    model = torch.jit.load(argv[0])  # type: ignore[no-untyped-call]  # torch.jit.load is unannotated
    loaded = time.monotonic() - started
    tensors = example_inputs(order_inputs(model, inputs))
    started = time.monotonic()
    with torch.no_grad():
        output = model(*tensors)
    print(f"[load-check] ok: loaded in {loaded:.2f} s, ran once in {time.monotonic() - started:.2f} s, "
          f"output {_shapes(output)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
