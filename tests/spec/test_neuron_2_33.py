"""Neuron SDK 2.33.0 / 2.33.1 in the packaged release table, built from the SDK's pages (issue 41, item 1).

The SDK's ``n2-manifest.json`` reachable here (aws-neuron/aws-neuron-sdk@81ce03ae) stops at 2.32.0, so the
2.33 entries come from the release-content and component pages and are marked ``from_docs``
(compilesvc/spec/neuron_releases.json cites each). What they say, checked here:

- 2.33.0 ships neuronx-cc 2.28.7631.0, torch-neuronx 2.9.0.2.15.32035 (listed again after 2.32.0 listed none),
  libneuronxla 3.0.10135.0, aws-neuronx-runtime-lib 2.35.30.0, and no NxD / NxD Inference
  (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/release-notes/releasecontent.html, "Neuron 2.33.0
  (10/19/2026)", Trn1 packages); vLLM Neuron 0.29.0.1.2.0
  (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/release-notes/components/index.html).
- 2.33.1 is "bug fixes applied to the AWS Neuron SDK v2.33.0"
  (https://github.com/aws-neuron/aws-neuron-sdk/releases/tag/v2.33.1); its packages are unverified.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from compilesvc.spec import neuron_kinds, neuron_releases, support_matrix
from compilesvc.spec.keys import compute_keys
from compilesvc.spec.neuron_releases import installed_mismatches, lookup
from compilesvc.spec.neuron_releases_refresh import refreshed_document
from compilesvc.spec.parsing import SpecError, parse_spec
from tests.spec.test_compile_targets import SHA, doc
from tests.spec.test_neuron_releases import _package, run_cli, sdk_manifest


def test_2_33_0_lists_the_packages_its_release_pages_name() -> None:
    release = lookup("2.33.0")
    assert release.neuronx_cc == "2.28.7631.0"
    assert release.torch_neuronx == ("2.9.0.2.15.32035",)  # listed again: 2.32.0 had none
    assert lookup("2.32.0").torch_neuronx == ()
    assert release.neuronx_distributed is None and release.neuronx_distributed_inference is None
    assert release.libneuronxla == ("3.0.10135.0",) and release.runtime_lib == "2.35.30.0"
    assert release.targets == ("inf2", "trn1", "trn2", "trn3")
    assert lookup("2.33.1").as_versions() | {"release": "2.33.0"} == release.as_versions()


def test_2_33_offers_trace_again_but_no_nxdi() -> None:
    for label in ("2.33.0", "2.33.1"):
        assert neuron_kinds.release_kinds(label) == ("neuronx-cc", "neuronx-cc-tp", "trace")
        with pytest.raises(neuron_kinds.NotShipped, match=r"ships no neuronx-distributed-inference"):
            neuron_kinds.require_kind(label, "nxdi", 1)
        with pytest.raises(neuron_kinds.NotShipped, match=r"ships no neuronx-distributed\b"):
            neuron_kinds.require_kind(label, "trace", 2)


def test_the_2_33_entries_are_marked_from_docs_with_their_pages() -> None:
    marks = neuron_releases.from_docs()
    assert set(marks) == {"2.33.0", "2.33.1"}
    assert "v2.33.0/release-notes/releasecontent.html" in marks["2.33.0"]
    assert "releases/tag/v2.33.1" in marks["2.33.1"]
    rows = {row[0]: row for row in support_matrix.rows()}
    assert rows["2.33.0"][-1].endswith("from docs, not the manifest")
    assert "from docs" not in rows["2.32.0"][-1]
    assert "vLLM Neuron 0.29" in rows["2.33.0"][-1]


def test_a_2_33_host_with_its_packages_has_no_mismatch_and_a_2_32_host_is_not_2_33() -> None:
    have = {"neuronx-cc": "2.28.7631.0+abc", "torch-neuronx": "2.9.0.2.15.32035", "libneuronxla": "3.0.10135.0"}
    assert installed_mismatches("2.33.0", have) == []
    assert installed_mismatches("2.33.1", have) == []
    assert installed_mismatches("2.33.0", {"neuronx-cc": "2.27.5334.0"}) == [
        "neuronx-cc: installed 2.27.5334.0, release 2.33.0 ships 2.28.7631.0"]


def test_2_33_specs_are_accepted_where_kinds_and_targets_allow() -> None:
    for sdk in ("2.33.0", "2.33.1"):
        hlo = parse_spec(doc("trn3", sdk), extra_flags=frozenset())
        keys = compute_keys(hlo, model_sha256=SHA, default_isa="x86_64-avx2")
        assert keys.material["toolchain"]["target"] == "trn3"
        trace = parse_spec(doc("inf2", sdk, model_format="torchscript"), extra_flags=frozenset())
        assert trace.backend == "trace" and trace.sdk == sdk
    # tp > 1 trace needs NxD, which 2.33.0 does not list: a 422 naming the package.
    with pytest.raises(SpecError, match=r"ships no neuronx-distributed"):
        parse_spec(doc("trn2", "2.33.0", model_format="torchscript", tp_degree=2), extra_flags=frozenset())
    # The same packages make the same toolchain key for 2.33.0 and 2.33.1 (one queue, one artifact).
    a, b = (compute_keys(parse_spec(doc("trn2", s), extra_flags=frozenset()), model_sha256=SHA,
                         default_isa="x86_64-avx2") for s in ("2.33.0", "2.33.1"))
    assert a.material["toolchain"] == b.material["toolchain"]


def test_refresh_from_a_manifest_carrying_2_33_replaces_the_doc_built_entries(tmp_path: Path) -> None:
    # A fixture in the n2-manifest format carrying 2.33.0 with another runtime build than the pages gave:
    # the SDK's own manifest wins, is not refused as a changed published release, and the mark goes.
    table_copy = tmp_path / "neuron_releases.json"
    table_copy.write_text(neuron_releases.table_path().read_text())
    manifest_233 = {"neuron_version": "2.33.0", "packages": [
        _package("neuronx-cc", "2.28.7631.0", ("inf2", "trn1", "trn2", "trn3")),
        _package("torch-neuronx", "2.9.0.2.15.32035"),
        _package("libneuronxla", "3.0.10135.0"),
        _package("aws-neuronx-runtime-lib", "2.35.31.0")]}
    source = tmp_path / "n2-manifest.json"
    source.write_text(json.dumps(sdk_manifest(manifest_233)))
    proc = run_cli(tmp_path, "neuron-releases", "refresh", "--from", source, "--to", table_copy)
    assert proc.returncode == 0, proc.stderr
    assert "changed none" in proc.stdout
    after = json.loads(table_copy.read_text())
    assert after["releases"]["2.33.0"]["aws-neuronx-runtime-lib"] == "2.35.31.0"
    assert set(after["from_docs"]) == {"2.33.1"}  # still provisional: the fixture does not carry it


def test_a_published_manifest_release_still_cannot_change() -> None:
    current = json.loads(neuron_releases.table_path().read_text())
    changed = {"neuron_version": "2.32.0", "packages": [_package("neuronx-cc", "2.27.9999.0")]}
    _, _, changes = refreshed_document(current, sdk_manifest(changed), "fixture")
    assert changes == ["2.32.0"]
