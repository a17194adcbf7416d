"""Bucket selection, checked against a brute-force reference over random bucket sets and requests, and
the errors a serving engineer reads when nothing fits."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compilesvc.fleet import NoBucketFits, select
from compilesvc.fleet._select import Shape


@dataclass(frozen=True)
class B:
    position: int
    shapes: dict[str, Shape]
    dtypes: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.dtypes:
            object.__setattr__(self, "dtypes", dict.fromkeys(self.shapes, "int64"))


def reference(buckets: list[B], request: dict[str, Shape]) -> B | None:
    """The policy as its definition reads, by exhaustion: every bucket that fits, the least padded one,
    ties to the smaller shapes in input-name order, then to the lower position."""
    fitting = []
    for b in buckets:
        if set(b.shapes) != set(request):
            continue
        if all(len(b.shapes[n]) == len(s) and all(c >= r for c, r in zip(b.shapes[n], s, strict=True))
               for n, s in request.items()):
            fitting.append(b)
    if not fitting:
        return None
    padded = {b.position: sum(math.prod(s) for s in b.shapes.values()) for b in fitting}
    least = min(padded.values())
    candidates = [b for b in fitting if padded[b.position] == least]
    names = sorted(request)
    smallest = min(tuple(b.shapes[n] for n in names) for b in candidates)
    return min((b for b in candidates if tuple(b.shapes[n] for n in names) == smallest), key=lambda b: b.position)


dims = st.integers(1, 9)


@st.composite
def bucket_sets(draw: st.DrawFn) -> tuple[list[B], dict[str, Shape]]:
    names = draw(st.sampled_from([("input_ids", "attention_mask"), ("x",), ("a", "b", "c")]))
    ranks = {n: draw(st.integers(1, 3)) for n in names}
    count = draw(st.integers(1, 8))
    buckets = [B(i, {n: tuple(draw(st.lists(dims, min_size=ranks[n], max_size=ranks[n]))) for n in names})
               for i in range(count)]
    # Requests drawn at and around the buckets' own sizes, so fits, ties and near misses all happen.
    request = {n: tuple(draw(st.lists(st.integers(0, 10), min_size=ranks[n], max_size=ranks[n]))) for n in names}
    return buckets, request


@settings(max_examples=300, deadline=None)
@given(bucket_sets())
def test_select_agrees_with_the_brute_force_reference(case: tuple[list[B], dict[str, Shape]]) -> None:
    buckets, request = case
    expected = reference(buckets, request)
    if expected is None:
        with pytest.raises(NoBucketFits) as caught:
            select(buckets, request)
        error = caught.value
        assert error.requested == request
        for miss in error.misses:  # every dimension it blames is larger than in every bucket
            assert all(b.shapes[miss.input][miss.dim] < miss.requested for b in buckets)
            assert miss.largest == max(b.shapes[miss.input][miss.dim] for b in buckets)
        if not error.misses:  # else each dimension fits some bucket, none fits all at once
            assert "no single compiled bucket" in str(error)
    else:
        assert select(buckets, request) is expected
        # Deterministic whatever order the buckets come in.
        assert select(list(reversed(buckets)), request) is expected


def test_the_least_padded_bucket_wins_and_ties_go_to_the_earlier_shape() -> None:
    buckets = [B(0, {"x": (8, 128)}), B(1, {"x": (1, 1024)}), B(2, {"x": (4, 256)}), B(3, {"x": (2, 512)})]
    # All four hold 1024 elements: the tie goes to the smaller shape in dimension order, [1, 1024].
    assert select(buckets, {"x": (1, 100)}) is buckets[1]
    assert select(buckets, {"x": (3, 200)}) is buckets[2]
    assert select(buckets, {"x": (8, 100)}) is buckets[0]


def test_arrays_and_tensors_give_their_shape_and_dtype() -> None:
    buckets = [B(0, {"input_ids": (1, 16), "attention_mask": (1, 16)}),
               B(1, {"input_ids": (4, 16), "attention_mask": (4, 16)})]
    ids = np.ones((2, 10), dtype=np.int64)
    assert select(buckets, {"input_ids": ids, "attention_mask": ids}).position == 1
    with pytest.raises(NoBucketFits, match="input_ids is float32, compiled as int64"):
        select(buckets, {"input_ids": ids.astype(np.float32), "attention_mask": ids})
    torch = pytest.importorskip("torch")
    t = torch.ones((1, 3), dtype=torch.int64)
    assert select(buckets, {"input_ids": t, "attention_mask": t}).position == 0
    # Nested lists are data (a list of token-id rows), a flat list of ints is a shape.
    assert select(buckets, {"input_ids": [[1, 2, 3]] * 3, "attention_mask": (3, 3)}).position == 1


@pytest.mark.parametrize(("request_", "message"), [
    ({"input_ids": (1, 700), "attention_mask": (1, 700)},
     "input_ids dim 1 is 700, the largest compiled is 512; attention_mask dim 1 is 700"),
    ({"input_ids": (8, 300), "attention_mask": (8, 300)},
     "no single compiled bucket fits input_ids[8, 300], attention_mask[8, 300]"),
    ({"input_ids": (1, 10)}, "takes exactly the inputs input_ids; the buckets take: attention_mask, input_ids"),
    ({"input_ids": (1, 10, 3), "attention_mask": (1, 10)}, "input_ids has 3 dimensions, compiled with 2"),
])
def test_nothing_fits_says_which_dimension(request_: dict[str, Shape], message: str) -> None:
    buckets = [B(0, {"input_ids": (8, 128), "attention_mask": (8, 128)}),
               B(1, {"input_ids": (1, 512), "attention_mask": (1, 512)})]
    with pytest.raises(NoBucketFits) as caught:
        select(buckets, request_)
    assert message in str(caught.value)


def test_bad_requests_are_type_errors_not_wrong_answers() -> None:
    buckets = [B(0, {"x": (2, 2)})]
    with pytest.raises(TypeError, match="input 'x'"):
        select(buckets, {"x": "2x2"})
    with pytest.raises(ValueError, match="different lengths"):
        select(buckets, {"x": [[1, 2], [3]]})
    with pytest.raises(ValueError, match="negative"):
        select(buckets, {"x": (2, -1)})
