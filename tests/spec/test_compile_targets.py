"""Neuron targets per release and logical NeuronCores (issue 28, deliverables 2 and 5).

Targets: the instance families the SDK's manifest lists for each release's neuronx-cc (aws-neuron/aws-neuron-sdk
src/helperscripts/n2-manifest.json at 81ce03ae, ``supported_instances``): trn1 from 2.3.0, inf2 from 2.8.0, trn2
from 2.21.0, trn3 from 2.29.0. LNC: 2 by default on trn2 (neuronx-cc CLI reference) and trn3 (NxD/NxDI
``get_platform_lnc``), 1 elsewhere, where 2 is NCC_EARG001.
"""

from __future__ import annotations

from typing import Any

import pytest

from compilesvc.dispatch.routing import queue_name
from compilesvc.spec.keys import compute_keys
from compilesvc.spec.neuron_kinds import TargetNotSupported, release_targets, require_target
from compilesvc.spec.neuronx_cc_options import default_lnc, effective_lnc
from compilesvc.spec.parsing import SpecError, parse_spec

SHA = "0123456789abcdef" * 4


def doc(target: str, sdk: str, *args: str, model_format: str = "hlo", tp_degree: int = 1) -> dict[str, Any]:
    return {"model": {"uri": f"blob:sha256:{SHA}", "format": model_format}, "target": target, "sdk": sdk,
            "compiler": {"args": list(args), "tp_degree": tp_degree}, "buckets": [{"batch_size": 1, "seq_len": 16}]}


def test_release_targets_follow_the_manifest() -> None:
    assert release_targets("2.3.0") == ("trn1",)
    assert release_targets("2.8.0") == release_targets("2.20.2") == ("inf2", "trn1")
    assert release_targets("2.21.0") == release_targets("2.28.1") == ("inf2", "trn1", "trn2")
    assert release_targets("2.29.0") == release_targets("2.32.0") == ("inf2", "trn1", "trn2", "trn3")


@pytest.mark.parametrize(("target", "sdk"), [("trn3", "2.28.1"), ("trn3", "2.27.1"), ("trn2", "2.20.0"),
                                             ("inf2", "2.7.0")])
def test_a_target_its_release_does_not_support_is_refused_naming_both(target: str, sdk: str) -> None:
    with pytest.raises(TargetNotSupported, match=rf"Neuron SDK {sdk} does not support target {target}"):
        require_target(sdk, target)
    with pytest.raises(SpecError) as caught:
        parse_spec(doc(target, sdk), extra_flags=frozenset())
    [error] = caught.value.errors
    assert error["field"] == "target"
    assert f"Neuron SDK {sdk} does not support target {target}" in error["message"]


def test_a_trn3_spec_from_2_29_0_is_keyed_and_queued_as_trn3() -> None:
    spec = parse_spec(doc("trn3", "2.29.0"), extra_flags=frozenset())
    keys = compute_keys(spec, model_sha256=SHA, default_isa="x86_64-avx2")
    assert keys.material["toolchain"]["target"] == "trn3" and keys.material["toolchain"]["lnc"] == 2
    assert queue_name("trn3", "2.29.0", "neuronx-cc") == "compile.trn3.2.29.0.neuronx-cc"
    trace = parse_spec(doc("trn3", "2.31.1", model_format="torchscript", tp_degree=2), extra_flags=frozenset())
    assert trace.backend == "trace"
    assert queue_name("trn3", "2.31.1", "trace", tp_degree=2).startswith("compile.trn3.")


def test_lnc_defaults_and_values_per_target() -> None:
    assert [default_lnc(t) for t in ("inf2", "trn1", "trn2", "trn3")] == [1, 1, 2, 2]
    assert effective_lnc("trn2", ["-O1"]) == (2, ["-O1"])
    assert effective_lnc("trn2", ["--logical-nc-config=1", "-O1"]) == (1, ["-O1"])
    # The "--" tail is verbatim: an option there is not the compile's LNC.
    assert effective_lnc("trn3", ["--", "--logical-nc-config=1"]) == (2, ["--", "--logical-nc-config=1"])
    parse_spec(doc("trn3", "2.29.0", "--lnc", "2"), extra_flags=frozenset())
    parse_spec(doc("trn3", "2.29.0", "-lnc", "1"), extra_flags=frozenset())
    with pytest.raises(SpecError, match=r"only accepted for target trn2, trn3, not inf2"):
        parse_spec(doc("inf2", "2.29.0", "--lnc", "2"), extra_flags=frozenset())


def test_writing_the_default_lnc_gives_the_key_of_omitting_it() -> None:
    def key(target: str, *args: str) -> str:
        return compute_keys(parse_spec(doc(target, "2.31.1", *args), extra_flags=frozenset()), model_sha256=SHA,
                            default_isa="x86_64-avx2").key

    for target, default, other in (("trn2", "2", "1"), ("trn3", "2", "1")):
        assert key(target) == key(target, "--lnc", default) == key(target, f"--logical-nc-config={default}")
        assert key(target) != key(target, "-lnc", other)
    assert key("trn1") == key("trn1", "--lnc=1") and key("inf2") == key("inf2", "-lnc", "1")
