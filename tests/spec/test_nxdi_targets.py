"""Targets per NxD Inference release (issue 41, item 4): narrower than the compiler's where NxDI says so.

- From SDK 2.29.0: "NxD Inference models are now only supported on Trn2 and newer hardware. Customers who
  require NxD Inference kernel support on Trn1 or Inf2 instances should pin to release 2.28."
  (aws-neuron/aws-neuron-sdk@81ce03ae release-notes/components/nxd-inference.rst:61, NxD Inference 0.9.17334).
- SDK 2.21.0 and 2.22.0: n2-manifest.json (same commit) lists neuronx_distributed_inference 0.1.0 / 0.2.0 with
  ``supported_instances: ["inf2", "trn2"]``, though their neuronx-cc lists trn1 too.
"""

from __future__ import annotations

import pytest

from compilesvc.spec import support_matrix
from compilesvc.spec.neuron_kinds import TargetNotSupported, nxdi_targets, release_targets, require_nxdi_target
from compilesvc.spec.parsing import SpecError, parse_spec
from tests.spec.test_nxdi_config import llm


def test_nxdi_targets_per_release() -> None:
    assert nxdi_targets("2.21.0") == nxdi_targets("2.22.0") == ("inf2", "trn2")
    assert nxdi_targets("2.21.1") == nxdi_targets("2.28.1") == ("inf2", "trn1", "trn2")
    for release in ("2.29.0", "2.29.1", "2.30.0", "2.31.0", "2.31.1"):
        assert release_targets(release) == ("inf2", "trn1", "trn2", "trn3")
        assert nxdi_targets(release) == ("trn2", "trn3")


@pytest.mark.parametrize(("sdk", "target", "reason"), [
    ("2.29.0", "inf2", "Trn2 and newer"), ("2.29.1", "trn1", "Trn2 and newer"), ("2.31.1", "inf2", "Trn2 and newer"),
    ("2.21.0", "trn1", "inf2, trn2 only"), ("2.22.0", "trn1", "inf2, trn2 only"),
])
def test_an_nxdi_spec_for_a_target_its_nxdi_does_not_support_is_a_422_naming_target(sdk: str, target: str,
                                                                                  reason: str) -> None:
    with pytest.raises(TargetNotSupported, match=reason):
        require_nxdi_target(sdk, target)
    with pytest.raises(SpecError) as raised:
        parse_spec(llm(target=target, sdk=sdk))
    [error] = raised.value.errors
    assert error["field"] == "target"
    assert f"NxD Inference of Neuron SDK {sdk} does not support target {target}" in error["message"]
    assert reason in error["message"]


@pytest.mark.parametrize(("sdk", "target"), [("2.29.1", "trn2"), ("2.29.0", "trn3"), ("2.28.1", "inf2"),
                                             ("2.28.1", "trn1"), ("2.21.1", "trn1"), ("2.22.0", "inf2")])
def test_supported_nxdi_combinations_are_accepted(sdk: str, target: str) -> None:
    spec = parse_spec(llm(target=target, sdk=sdk))
    assert (spec.target, spec.sdk, spec.backend) == (target, sdk, "nxdi")


def test_an_hlo_spec_of_2_29_still_takes_inf2() -> None:
    # The narrowing is NxDI's, not the compiler's: neuronx-cc of 2.29.0 lists inf2.
    assert "inf2" in release_targets("2.29.0")


def test_the_matrix_shows_nxdi_targets_where_narrower() -> None:
    rows = {row[0]: row for row in support_matrix.rows()}
    assert "`nxdi` (trn2, trn3 only)" in rows["2.29.0"][5]
    assert "`nxdi` (inf2, trn2 only)" in rows["2.21.0"][5]
    assert rows["2.28.1"][5].endswith("`nxdi`")
