"""Padding to a bucket (lists, numpy, torch; right and left; batch rows too) and cropping back; the
host check against recorded versions."""

from __future__ import annotations

import subprocess
import sys
import warnings

import numpy as np
import pytest

from compilesvc.fleet import HostCheck, VersionMismatch, VersionMismatchWarning, crop, pad
from compilesvc.fleet._host import compare, enforce
from compilesvc.hostinfo import isa_runs_on
from tests.fleet.test_select import B

BUCKET = B(0, {"input_ids": (2, 5), "attention_mask": (2, 5)})


def test_pad_lists_right_and_left() -> None:
    padded = pad({"input_ids": [[7, 8, 9]], "attention_mask": [[1, 1, 1]]}, BUCKET, values={"input_ids": 99})
    assert padded == {"input_ids": [[7, 8, 9, 99, 99], [99, 99, 99, 99, 99]],
                      "attention_mask": [[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]]}
    left = pad({"input_ids": [[7, 8, 9]], "attention_mask": [[1, 1, 1]]}, BUCKET, side="left")
    assert left["input_ids"] == [[0, 0, 0, 0, 0], [0, 0, 7, 8, 9]]
    assert left["attention_mask"] == [[0, 0, 0, 0, 0], [0, 0, 1, 1, 1]]
    assert crop(left["input_ids"], (1, 3), side="left") == [[7, 8, 9]]
    assert crop(padded["input_ids"], (1, 3)) == [[7, 8, 9]]


def test_pad_numpy_and_torch_keep_their_kind() -> None:
    ids = np.array([[5, 6]], dtype=np.int64)
    out = pad({"input_ids": ids, "attention_mask": np.ones_like(ids)}, BUCKET)
    assert isinstance(out["input_ids"], np.ndarray) and out["input_ids"].shape == (2, 5)
    assert out["input_ids"].dtype == np.int64 and out["attention_mask"].sum() == 2
    assert crop(out["input_ids"], (1, 2)).tolist() == [[5, 6]]
    torch = pytest.importorskip("torch")
    t = torch.tensor([[5, 6, 7]])
    padded = pad({"input_ids": t, "attention_mask": torch.ones_like(t)}, BUCKET, side="left")
    assert isinstance(padded["input_ids"], torch.Tensor)
    assert padded["input_ids"].tolist() == [[0, 0, 0, 0, 0], [0, 0, 5, 6, 7]]
    hidden = torch.zeros((2, 5, 4))  # an output with a trailing hidden dimension: kept
    assert tuple(crop(hidden, (1, 3), side="left").shape) == (1, 3, 4)


def test_pad_refuses_what_it_cannot_do() -> None:
    with pytest.raises(ValueError, match="larger than the bucket"):
        pad({"input_ids": [[1] * 6], "attention_mask": [[1] * 6]}, BUCKET)
    with pytest.raises(ValueError, match="no input token_type_ids"):
        pad({"token_type_ids": [[0]]}, BUCKET)
    with pytest.raises(ValueError, match="side must be"):
        pad({"input_ids": [[1]]}, BUCKET, side="middle")  # type: ignore[arg-type]


NEURON = {"torch": "2.9.0", "torch_neuronx": "2.9.0.2.11.19912", "neuronx_cc": "2.22.12471.0",
          "aws_neuronx_runtime_lib": "2.29.40.0"}


def test_compare_names_every_difference() -> None:
    same = compare(NEURON, packages={"torch": "2.9.0+cpu", "torch-neuronx": "2.9.0.2.11.19912"},
                   runtime="2.29.40.0")
    assert same.mismatches == [] and same.unknown == []  # a local build tag is the same torch
    other = compare(NEURON, packages={"torch": "2.8.0", "torch-neuronx": None}, runtime="2.28.1.0")
    assert other.mismatches == [
        "torch: built with 2.9.0, this host has 2.8.0",
        "torch-neuronx: built with 2.9.0.2.11.19912, this host has none installed",
        "aws-neuronx-runtime-lib: built for 2.29.40.0, this host has 2.28.1.0"]
    unknown_runtime = compare({"aws_neuronx_runtime_lib": "2.29.40.0"}, packages={}, runtime=None)
    assert unknown_runtime.mismatches == [] and "cannot be read" in unknown_runtime.unknown[0]


@pytest.mark.parametrize(("built", "host", "runs"), [
    ("x86_64-avx2", "x86_64-avx512", True), ("x86_64-avx512", "x86_64-avx512_amx", True),
    ("x86_64-avx512_amx", "x86_64-avx512", False), ("x86_64-avx512", "x86_64-avx2", False),
    ("x86_64-default", "x86_64-avx2", True), ("aarch64-neon", "aarch64-sve", True),
    ("aarch64-sve", "aarch64-neon", False), ("x86_64-avx2", "aarch64-sve", False),
])
def test_isa_rules(built: str, host: str, runs: bool) -> None:
    assert isa_runs_on(built, host) is runs
    assert (compare({"isa": built}, packages={}, isa=host).mismatches == []) is runs


def test_enforce_refuses_warns_or_stays_quiet() -> None:
    foreign = [{"torch_neuronx": "0.0.0-not-this-host"}]
    with pytest.raises(VersionMismatch) as caught:
        enforce("k" * 64, foreign, HostCheck.REFUSE)
    assert "torch-neuronx: built with 0.0.0-not-this-host" in str(caught.value)
    assert "COMPILESVC_HOST_CHECK=warn" in str(caught.value)
    with pytest.warns(VersionMismatchWarning, match="torch-neuronx"):
        report = enforce("k" * 64, foreign, HostCheck.WARN)
    assert report.mismatches
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert enforce("k" * 64, foreign, HostCheck.OFF).mismatches == []


def test_the_library_imports_no_framework() -> None:
    code = ("import sys, compilesvc.fleet; heavy = {'torch', 'numpy', 'flask', 'celery', 'click', 'sqlalchemy'}"
            " & set(sys.modules); print(sorted(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
