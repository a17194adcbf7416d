"""docs/neuron-hosts.md's support matrix is what the code derives from the release table (issue 28)."""

from __future__ import annotations

from pathlib import Path

import pytest

from compilesvc.spec import support_matrix
from compilesvc.spec.neuron_releases import table

DOC = Path(__file__).resolve().parents[2] / "docs" / "neuron-hosts.md"


def test_the_documented_matrix_is_the_generated_one() -> None:
    # On failure: regenerate with `python -m compilesvc.spec.support_matrix` and paste it between the markers.
    assert support_matrix.documented(DOC.read_text(encoding="utf-8")) == support_matrix.markdown()


def test_the_matrix_has_a_row_per_release_with_its_kinds() -> None:
    rows = {row[0]: row for row in support_matrix.rows()}
    assert list(rows) == list(reversed(table()))
    assert rows["2.32.0"][2:4] == ("—", "—") and rows["2.32.0"][5] == "`neuronx-cc`, `neuronx-cc-tp`"
    assert rows["2.27.1"][5] == "`neuronx-cc`, `neuronx-cc-tp`, `trace`, `trace-tp`, `nxdi`"
    assert rows["2.20.2"][5] == "`neuronx-cc`, `neuronx-cc-tp`, `trace`, `trace-tp`"  # NxDI from 2.21.0


def test_targets_per_release_are_the_manifests_instance_families() -> None:
    # n2-manifest.json (aws-neuron-sdk@81ce03ae), neuronx-cc's supported_instances: trn1 from 2.3.0, inf2 from
    # 2.8.0, trn2 from 2.21.0, trn3 from 2.29.0.
    rows = {row[0]: row for row in support_matrix.rows()}
    assert (rows["2.3.0"][4], rows["2.8.0"][4], rows["2.20.2"][4]) == ("trn1", "inf2, trn1", "inf2, trn1")
    assert (rows["2.21.0"][4], rows["2.28.1"][4]) == ("inf2, trn1, trn2", "inf2, trn1, trn2")
    assert rows["2.29.0"][4] == rows["2.32.0"][4] == "inf2, trn1, trn2, trn3"


def test_sdk_status_per_release_links_the_sdks_pages() -> None:
    rows = {row[0]: row for row in support_matrix.rows()}
    assert rows["2.29.1"][6] == "—"
    assert "announce-maintenance-nxdi-nxd-core-inference.html" in rows["2.30.0"][6]
    assert "announce-maintenance-pytorch-xla-inference.html" not in rows["2.30.0"][6]
    for link in ("announce-maintenance-pytorch-xla-inference.html", "announce-nxdi-maintenance-support-2-31.html"):
        assert link in rows["2.31.0"][6] and link in rows["2.32.0"][6]
    assert "vllm-neuron-beta" in rows["2.31.1"][6] and "vllm-neuron-beta" not in rows["2.31.0"][6]
    for announcement in support_matrix.ANNOUNCEMENTS:
        assert announcement.url.startswith("https://awsdocs-neuron.readthedocs-hosted.com/en/latest/")
        assert announcement.source and announcement.since in table()


def test_a_doc_without_the_markers_is_named() -> None:
    with pytest.raises(ValueError, match="no generated support matrix"):
        support_matrix.documented("# nothing here\n")
