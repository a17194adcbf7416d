"""Hostile TorchScript models: what a team with a ``submit`` token can make a worker run.

The cpu backends load a ``torchscript`` model and run its ``forward`` once at the bucket's example inputs
(:func:`workers.compiling.model_loading.run_forward`) before tracing it, then run the saved artifact again to compare.
TorchScript is a restricted language: no ``open``, ``os``, ``socket`` or ``subprocess``, no try/except;
what it has is every ATen operator, and ``aten::from_file(filename, shared, size)`` maps any file the
process can open (``shared=True``: read-write, ``MAP_SHARED``, so writes reach the file; a missing file is
created and grown to ``size``). That is the file system reach of a model; the rest of the payloads use
plain tensor ops (an endless loop, a huge ``empty``).

Each payload is one scripted :class:`Hostile` module whose attributes say what it does. What it read
leaves the compile in one of two ways (``channel``):

- ``error``: raised as ``RuntimeError("LOOT[...]")``, bytes outside printable ASCII shown as ``.``: the
  build's error, its log lines, the UI and ``log.txt`` repeat it;
- ``artifact``: copied into a ``uint8`` buffer of the module, which ``torch.jit.save`` stores (uncompressed)
  in the published ``model.pt``.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import torch

MIB = 1024 * 1024


class Hostile(torch.nn.Module):
    """``forward(input_ids, attention_mask)`` that first does ``action`` (read, write, loop, alloc, fill,
    benign), then returns a value that depends only on its inputs (so the artifact check passes)."""

    def __init__(self, action: str, path: str = "", size: int = 0, channel: str = "error", count: int = 0,
                 marker: str = "") -> None:
        super().__init__()
        self.action = action
        self.path = path
        self.size = size
        self.channel = channel
        self.count = count
        self.marker = marker  # a victim's bytes that must never show up in another team's answers
        self.register_buffer("loot", torch.zeros(size if channel == "artifact" else 0, dtype=torch.uint8))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        # Every tensor an action makes flows into the output (times zero): TorchScript's executor drops
        # work whose result nothing uses, which would make an attack a no-op.
        touched = torch.zeros(1)
        if self.action == "read":
            data = torch.from_file(self.path, shared=False, size=self.size, dtype=torch.uint8)
            if self.channel == "artifact":
                self.loot.copy_(data)  # type: ignore[operator]
                touched = touched + self.loot[-1:].to(torch.float32) * 0  # type: ignore[index]
            else:
                values: list[int] = data.to(torch.int64).tolist()
                chars: list[str] = []
                for value in values:
                    chars.append(chr(value) if 32 <= value < 127 else ".")
                raise RuntimeError("LOOT[" + "".join(chars) + "]")
        elif self.action == "write":
            target = torch.from_file(self.path, shared=True, size=self.size, dtype=torch.uint8)
            target.fill_(65)  # "AAAA…" over the first bytes of the victim
            touched = touched + target[-1:].to(torch.float32) * 0
        elif self.action == "loop":
            spins = 0
            while spins >= 0:  # never ends: only the time limit stops it
                spins = (spins + 1) % 1000000
        elif self.action == "alloc":
            huge = torch.empty(self.size, dtype=torch.uint8)
            huge.fill_(1)
            touched = touched + huge[-1:].to(torch.float32) * 0
        elif self.action == "fill":
            # ``count`` files of ``size`` bytes in the work dir (cwd), each under the file size limit, together
            # over the disk limit; then wait for the runner's disk watch to notice.
            for index in range(self.count):
                chunk = torch.from_file("fill-" + str(index) + ".bin", shared=True, size=self.size,
                                        dtype=torch.uint8)
                chunk.fill_(7)
                touched = touched + chunk[-1:].to(torch.float32) * 0
            spins = 0
            while spins >= 0:
                spins = (spins + 1) % 1000000
        return (input_ids * attention_mask).to(torch.float32).sum(dim=1, keepdim=True) + touched


@dataclass(frozen=True)
class Attack:
    """One hostile model and what must hold after it ran."""

    name: str
    model: Hostile
    #: Error classes / codes the build may end with (a compile error, a sandbox limit or the time limit).
    classes: frozenset[str] = frozenset({"compile"})
    code: str | None = None
    #: The build may also succeed harmlessly (a write into the sandbox's own copy of something).
    may_succeed: bool = False


def model_bytes(model: Hostile) -> bytes:
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(model), buffer)
    return buffer.getvalue()


def printable(data: bytes) -> str:
    """What the ``error`` channel shows of ``data`` (see :class:`Hostile`)."""
    return "".join(chr(b) if 32 <= b < 127 else "." for b in data)


def read(name: str, path: str, size: int, channel: str = "error") -> Attack:
    return Attack(name, Hostile("read", path, max(size, 1), channel))


def write(name: str, path: str, size: int) -> Attack:
    return Attack(name, Hostile("write", path, max(size, 1)), may_succeed=True)
