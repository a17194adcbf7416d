"""Build the bundled demo model: a tiny transformer classifier saved as a torch.export program.

Writes ``tiny-model.pt2`` (``torch.export.save``) and ``spec.json`` into ``compilesvc/demo/`` (or
``--out``). The model takes ``input_ids`` and ``attention_mask`` (int64, ``[batch, seq]``), as the spec's
``{batch_size, seq_len}`` bucket shorthand expects, and is exported with dynamic batch (1..64) and sequence
(2..128) dimensions so one file serves every demo bucket. Weights come from a fixed seed, so the model's
behaviour is reproducible; rerun this script after changing it and commit both files.

    .venv/bin/python examples/tiny-model/make_model.py [--out DIR] [--seed 0]
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch
from torch import nn

VOCAB = 128
D_MODEL = 32
HEADS = 2
FF = 64
MAX_LEN = 128
CLASSES = 4

#: The demo spec's buckets: small, medium and large enough to show three compiles.
BUCKETS = [{"batch_size": 1, "seq_len": 16}, {"batch_size": 4, "seq_len": 32}, {"batch_size": 8, "seq_len": 64}]
DEFAULT_OUT = Path(__file__).resolve().parents[2] / "compilesvc" / "demo"


class TinyModel(nn.Module):
    """Token + position embeddings, one transformer encoder layer, masked mean pooling, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, D_MODEL)
        self.positions = nn.Embedding(MAX_LEN, D_MODEL)
        self.encoder = nn.TransformerEncoderLayer(D_MODEL, HEADS, FF, dropout=0.0, batch_first=True)
        self.head = nn.Linear(D_MODEL, CLASSES)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.tokens(input_ids) + self.positions(positions)[None]
        x = self.encoder(x, src_key_padding_mask=attention_mask == 0)
        weights = attention_mask.unsqueeze(-1).to(x.dtype)
        pooled = (x * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)
        return self.head(pooled)


def build(seed: int = 0) -> TinyModel:
    torch.manual_seed(seed)
    return TinyModel().eval()


def export(model: TinyModel) -> torch.export.ExportedProgram:
    batch = torch.export.Dim("batch", min=1, max=64)
    seq = torch.export.Dim("seq", min=2, max=MAX_LEN)
    example = (torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0)),
               torch.ones(2, 16, dtype=torch.int64))
    shapes = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}
    return torch.export.export(model, example, dynamic_shapes=shapes)


def demo_spec(model_sha256: str) -> dict[str, object]:
    """The demo CompileSpec. ``model.uri`` names the model file's content; the dev launcher uploads that
    file to the blob store under this digest (compilesvc.demo.demo_spec recomputes it at run time)."""
    return {
        "model": {"uri": f"blob:sha256:{model_sha256}", "format": "exported-program",
                  "name": "tiny-model (compilesvc demo)"},
        "target": "cpu",
        "sdk": "2.13.0",
        "compiler": {"backend": "torchscript", "args": ["--freeze"]},
        "buckets": BUCKETS,
        "labels": {"source": "compilesvc demo"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()
    options.out.mkdir(parents=True, exist_ok=True)
    model_path = options.out / "tiny-model.pt2"
    torch.export.save(export(build(options.seed)), str(model_path))
    digest = hashlib.sha256(model_path.read_bytes()).hexdigest()
    (options.out / "spec.json").write_text(json.dumps(demo_spec(digest), indent=2) + "\n")
    print(f"wrote {model_path} ({model_path.stat().st_size} bytes, sha256 {digest}) and spec.json")


if __name__ == "__main__":
    main()
