"""Padding a request up to the compiled shapes of the bucket :func:`select` chose, and cropping outputs
back. Works on torch tensors, numpy arrays and nested lists, returning the same kind; torch and numpy are
imported only when the values are theirs.

For the usual transformer request, ``input_ids`` pads with the tokenizer's pad token and
``attention_mask`` with 0, so the padded positions are masked out; pad on the right for encoders, on
the left for decoders that generate from the last position (``side="left"``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from compilesvc.fleet._select import HasInputs, Shape, shape_of_data

Side = Literal["right", "left"]
#: Pad values when none is given: 0 masks padded positions out of attention and is the usual pad id.
DEFAULT_PAD_VALUE = 0


def _library(value: Any) -> str:
    return type(value).__module__.split(".", 1)[0]


def _pad_one(value: Any, target: Shape, fill: Any, side: Side) -> Any:
    # Data, never a shape: a flat list here is token ids, not dimensions.
    shape = tuple(int(d) for d in value.shape) if hasattr(value, "shape") else shape_of_data(value)
    if shape == target:
        return value
    extra = [t - s for s, t in zip(shape, target, strict=True)]
    if any(e < 0 for e in extra):
        raise ValueError(f"shape {list(shape)} is larger than the bucket's {list(target)} (select a bucket first)")
    pairs = [(e, 0) if side == "left" else (0, e) for e in extra]
    kind = _library(value)
    if kind == "torch":
        import torch.nn.functional as F

        flat = [n for pair in reversed(pairs) for n in pair]  # F.pad takes the last dimension first
        return F.pad(value, flat, value=fill)
    if kind == "numpy":
        import numpy as np

        return np.pad(value, pairs, constant_values=fill)
    if hasattr(value, "shape"):
        raise TypeError(f"cannot pad a {type(value).__name__}; pass a torch tensor, a numpy array or lists")
    return _pad_lists(list(value), list(target), fill, side)


def _pad_lists(value: list[Any], target: list[int], fill: Any, side: Side) -> list[Any]:
    inner = target[1:]
    rows = [_pad_lists(list(v), inner, fill, side) for v in value] if inner else list(value)
    padding = [_blank(inner, fill) for _ in range(target[0] - len(value))]
    return padding + rows if side == "left" else rows + padding


def _blank(shape: Sequence[int], fill: Any) -> Any:
    return [_blank(shape[1:], fill) for _ in range(shape[0])] if shape else fill


def pad(inputs: Mapping[str, Any], bucket: HasInputs, *, values: Mapping[str, Any] | None = None,
        side: Side = "right") -> dict[str, Any]:
    """Every input padded to ``bucket``'s shape in every dimension (batch too: padded rows are all
    ``values[name]``, default 0). Inputs must already fit (see :func:`compilesvc.fleet.select`)."""
    if side not in ("right", "left"):
        raise ValueError(f"side must be 'right' or 'left', not {side!r}")
    shapes = bucket.shapes
    unknown = sorted(set(inputs) - set(shapes))
    if unknown:
        raise ValueError(f"the bucket has no input {', '.join(unknown)}; it takes {', '.join(sorted(shapes))}")
    fills = values or {}
    return {name: _pad_one(value, shapes[name], fills.get(name, DEFAULT_PAD_VALUE), side)
            for name, value in inputs.items()}


def crop(output: Any, shape: Sequence[int], *, side: Side = "right") -> Any:
    """``output``'s leading dimensions cut back to ``shape`` (the request's shape before padding), from
    the side padding was added on; trailing dimensions (hidden size, vocabulary) are kept."""
    index = tuple(slice(-n, None) if side == "left" and n else slice(0, n) for n in shape)
    if _library(output) in ("torch", "numpy"):
        return output[index]
    return _crop_lists(output, list(shape), side)


def _crop_lists(value: Any, shape: list[int], side: Side) -> Any:
    if not shape:
        return value
    n = shape[0]
    rows = value[len(value) - n:] if side == "left" else value[:n]
    return [_crop_lists(row, shape[1:], side) for row in rows]
