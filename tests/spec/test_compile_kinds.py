"""Compile kinds per release (issue 28, deliverable 1): a spec is accepted only for a kind its release ships.

The release table (compilesvc/spec/neuron_releases.json) equals the SDK's own manifest
(aws-neuron/aws-neuron-sdk src/helperscripts/n2-manifest.json, manifest_version 2.32.0): 2.32.0 ships
neuronx-cc but no torch-neuronx and no neuronx-distributed; releases up to 2.10.0 ship no
neuronx-distributed.
"""

from __future__ import annotations

from typing import Any

import pytest

from compilesvc.dispatch.routing import queue_name
from compilesvc.spec.keys import compute_keys
from compilesvc.spec.neuron_kinds import KIND_PACKAGES, NotShipped, compile_kind, release_kinds, require_kind
from compilesvc.spec.neuron_releases import UnknownRelease, table
from compilesvc.spec.parsing import SpecError, parse_spec

SHA = "0123456789abcdef" * 4


def doc(sdk: str, model_format: str = "torchscript", tp_degree: int = 1) -> dict[str, Any]:
    return {"model": {"uri": f"blob:sha256:{SHA}", "format": model_format}, "target": "trn2", "sdk": sdk,
            "compiler": {"tp_degree": tp_degree}, "buckets": [{"batch_size": 1, "seq_len": 16}]}


def test_kinds_follow_what_each_release_ships() -> None:
    assert release_kinds("2.27.1") == ("neuronx-cc", "neuronx-cc-tp", "trace", "trace-tp", "nxdi")
    assert release_kinds("2.20.2") == ("neuronx-cc", "neuronx-cc-tp", "trace", "trace-tp")  # NxDI from 2.21.0
    assert release_kinds("2.32.0") == ("neuronx-cc", "neuronx-cc-tp")
    assert release_kinds("2.10.0") == ("neuronx-cc", "neuronx-cc-tp", "trace")  # no NxD yet
    for label, entry in table().items():  # every listed release ships neuronx-cc: HLO is always there
        kinds = release_kinds(label)
        assert "neuronx-cc" in kinds
        assert ("trace" in kinds) == bool(entry.torch_neuronx), label
        assert ("trace-tp" in kinds) == bool(entry.torch_neuronx and entry.neuronx_distributed), label
        assert ("nxdi" in kinds) == bool(entry.neuronx_distributed_inference), label
    with pytest.raises(UnknownRelease):
        release_kinds("2.99.0")


def test_a_kind_is_named_as_queues_name_it() -> None:
    assert [compile_kind(b, tp) for b, tp in (("neuronx-cc", 1), ("neuronx-cc", 8), ("trace", 1), ("trace", 2),
                                              ("nxdi", 8))] == list(KIND_PACKAGES)
    assert compile_kind("nxdi", 1) == "nxdi"  # NxDI's tp degree does not make another kind of compile
    assert queue_name("trn2", "2.27.1", "nxdi", tp_degree=32) == "compile.trn2.2.27.1.nxdi"
    assert queue_name("inf2", "2.32.0", "neuronx-cc").endswith(".neuronx-cc")
    with pytest.raises(ValueError, match="not a Neuron backend"):
        compile_kind("torchscript", 1)


@pytest.mark.parametrize(("release", "backend", "tp_degree", "missing"), [
    ("2.32.0", "trace", 1, "torch-neuronx"),
    ("2.32.0", "trace", 4, "torch-neuronx"),  # the first package the kind lacks
    ("2.10.0", "trace", 2, "neuronx-distributed"),
])
def test_require_kind_names_the_release_and_the_missing_package(release: str, backend: str, tp_degree: int,
                                                                missing: str) -> None:
    with pytest.raises(NotShipped, match=f"Neuron SDK {release} ships no {missing}") as caught:
        require_kind(release, backend, tp_degree)
    assert (caught.value.release, caught.value.package) == (release, missing)


@pytest.mark.parametrize(("release", "model_format", "tp_degree", "missing"), [
    ("2.32.0", "torchscript", 1, "torch-neuronx"),
    ("2.32.0", "hf-dir", 2, "torch-neuronx"),
    ("2.10.0", "torchscript", 2, "neuronx-distributed"),
])
def test_a_spec_for_a_kind_its_release_does_not_ship_is_refused(release: str, model_format: str, tp_degree: int,
                                                                 missing: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(doc(release, model_format, tp_degree))
    [error] = caught.value.errors
    assert error["field"] == "compiler.backend"
    assert f"Neuron SDK {release} ships no {missing}" in error["message"]


def test_an_hlo_spec_for_2_32_0_is_accepted_keyed_and_queued() -> None:
    for tp_degree in (1, 2):
        spec = parse_spec(doc("2.32.0", "hlo", tp_degree))
        keys = compute_keys(spec, model_sha256=SHA, default_isa="x86_64-avx2")
        assert keys.material["toolchain"]["neuron"] == {"neuronx-cc": "2.27.5334.0"}
        kind = "neuronx-cc-tp" if tp_degree > 1 else "neuronx-cc"
        assert queue_name(spec.target, spec.sdk, spec.backend, tp_degree=tp_degree) == f"compile.trn2.2.32.0.{kind}"
