"""Which compiled bucket serves a request: the policy, and the error that names what did not fit.

The policy (docs/fleet.md): a bucket *fits* a request when it has exactly the request's input names, each
input has the request's rank and, where the request says, its dtype, and every dimension is at least the
request's. Of the buckets that fit, the one chosen holds the fewest elements in total (the least padding,
so the least wasted compute); ties go to the smaller shapes compared dimension by dimension in input-name
order, then to the lower position. Nothing is ever truncated: a request larger than every bucket in some
dimension is an error naming that dimension.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

Shape = tuple[int, ...]


class HasInputs(Protocol):
    """A compiled bucket as far as selection cares: its position and its inputs' shapes and dtypes."""

    @property
    def position(self) -> int: ...

    @property
    def shapes(self) -> dict[str, Shape]: ...

    @property
    def dtypes(self) -> dict[str, str]: ...


@dataclass(frozen=True)
class Miss:
    """A dimension of the request larger than in any compiled bucket of the right names and ranks."""

    input: str
    dim: int
    requested: int
    largest: int

    def __str__(self) -> str:
        return f"{self.input} dim {self.dim} is {self.requested}, the largest compiled is {self.largest}"


class NoBucketFits(ValueError):
    """No compiled bucket fits the request; ``misses`` names the dimensions too large for every bucket
    (empty when each dimension fits some bucket but no one bucket fits them all)."""

    def __init__(self, message: str, requested: dict[str, Shape], misses: Sequence[Miss] = ()):
        super().__init__(message)
        self.requested = requested
        self.misses = list(misses)


def dtype_name(dtype: Any) -> str:
    """``torch.int64``, ``numpy.dtype('int64')``, ``"int64"`` and ``int64`` all as ``"int64"``."""
    text = str(getattr(dtype, "name", None) or dtype)
    return text.rsplit(".", 1)[-1]


def shape_of_data(value: Sequence[Any]) -> Shape:
    """The shape of data as (nested) lists: rectangular, or ValueError."""
    shape = [len(value)]
    first = value[0] if value else None
    if isinstance(first, (list, tuple)):
        inner = {shape_of_data(v) if isinstance(v, (list, tuple)) else () for v in value}
        if len(inner) != 1:
            raise ValueError("nested lists of different lengths have no shape")
        shape.extend(inner.pop())
    return tuple(shape)


def describe_request(inputs: Mapping[str, Any]) -> tuple[dict[str, Shape], dict[str, str]]:
    """Shapes (and dtypes, where known) of a request. A value is an array or tensor (its ``.shape`` and
    ``.dtype``), a shape (a flat sequence of ints), or data as nested lists (list of lists)."""
    shapes: dict[str, Shape] = {}
    dtypes: dict[str, str] = {}
    for name, value in inputs.items():
        if hasattr(value, "shape"):
            shapes[name] = tuple(int(d) for d in value.shape)
            if hasattr(value, "dtype"):
                dtypes[name] = dtype_name(value.dtype)
        elif isinstance(value, (list, tuple)) and all(isinstance(d, int) and not isinstance(d, bool) for d in value):
            shapes[name] = tuple(value)
        elif isinstance(value, (list, tuple)):
            shapes[name] = shape_of_data(value)
        else:
            raise TypeError(f"input {name!r}: expected an array, a tensor, a shape or nested lists, "
                            f"not {type(value).__name__}")
        if any(d < 0 for d in shapes[name]):
            raise ValueError(f"input {name!r}: negative dimension in {list(shapes[name])}")
    return shapes, dtypes


def order_key(bucket: HasInputs) -> tuple[int, tuple[Shape, ...], int]:
    """The policy's preference among buckets that fit: fewest elements, smaller shapes, lower position."""
    shapes = bucket.shapes
    return (sum(math.prod(s) for s in shapes.values()), tuple(shapes[n] for n in sorted(shapes)), bucket.position)


def fits(bucket: HasInputs, shapes: Mapping[str, Shape], dtypes: Mapping[str, str]) -> bool:
    have = bucket.shapes
    if set(have) != set(shapes):
        return False
    for name, shape in shapes.items():
        if name in dtypes and dtypes[name] != bucket.dtypes[name]:
            return False
        compiled = have[name]
        if len(compiled) != len(shape) or any(c < r for c, r in zip(compiled, shape, strict=True)):
            return False
    return True


def select(buckets: Sequence[HasInputs], inputs: Mapping[str, Any]) -> HasInputs:
    """The bucket the policy picks for ``inputs`` (see the module docstring), else :class:`NoBucketFits`."""
    shapes, dtypes = describe_request(inputs)
    best = min((b for b in buckets if fits(b, shapes, dtypes)), key=order_key, default=None)
    if best is None:
        raise _no_fit(buckets, shapes, dtypes)
    return best


def _fmt(shapes: Mapping[str, Shape]) -> str:
    return ", ".join(f"{name}{list(shape)}" for name, shape in shapes.items())


def _no_fit(buckets: Sequence[HasInputs], shapes: dict[str, Shape], dtypes: dict[str, str]) -> NoBucketFits:
    request = _fmt(shapes)
    names = [b for b in buckets if set(b.shapes) == set(shapes)]
    if not names:
        known = sorted({", ".join(sorted(b.shapes)) for b in buckets})
        return NoBucketFits(f"no compiled bucket takes exactly the inputs {', '.join(sorted(shapes))}; the "
                            f"buckets take: {' | '.join(known)}", shapes)
    typed = [b for b in names if all(dtypes.get(n, b.dtypes[n]) == b.dtypes[n] for n in shapes)]
    if not typed:
        wrong = [f"{n} is {dtypes[n]}, compiled as {names[0].dtypes[n]}" for n in sorted(dtypes)
                 if dtypes[n] != names[0].dtypes[n]]
        return NoBucketFits(f"no compiled bucket takes these dtypes: {'; '.join(wrong)}", shapes)
    ranked = [b for b in typed if all(len(b.shapes[n]) == len(s) for n, s in shapes.items())]
    if not ranked:
        ranks = [f"{n} has {len(s)} dimensions, compiled with {len(typed[0].shapes[n])}"
                 for n, s in sorted(shapes.items()) if len(typed[0].shapes[n]) != len(s)]
        return NoBucketFits(f"no compiled bucket has these ranks: {'; '.join(ranks)}", shapes)
    misses = []
    for name, shape in shapes.items():
        for dim, requested in enumerate(shape):
            largest = max(b.shapes[name][dim] for b in ranked)
            if requested > largest:
                misses.append(Miss(name, dim, requested, largest))
    if misses:
        return NoBucketFits(f"no compiled bucket fits {request}: {'; '.join(map(str, misses))}", shapes, misses)
    compiled = "; ".join(_fmt(b.shapes) for b in sorted(ranked, key=order_key))
    return NoBucketFits(f"no single compiled bucket fits {request}, although each dimension fits some "
                        f"bucket; compiled: {compiled}", shapes)
