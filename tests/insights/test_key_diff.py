"""Why a key missed: the changes from the closest earlier artifact of the same model, read as a person would
("sdk 2.20.0 → 2.21.0", "flag -O2 → -O3", "bucket … is new"), computed over real submits on both ledgers."""

from __future__ import annotations

from typing import Any

from compilesvc.builds.submit import Submitter
from compilesvc.insights.key_diff import changes, explain_miss, given_fields
from compilesvc.ledger.models import Build
from compilesvc.services import Services
from compilesvc.spec.nxdi_config import canonical_neuron_config
from compilesvc.spec.parsing import parse_spec
from tests.fixtures.submits import upload_model

ONE = [{"batch_size": 1, "seq_len": 128}]



def neuron_spec(uri: str, *, sdk: str = "2.20.0", args: list[str] | None = None, target: str = "inf2",
                buckets: list[dict[str, int]] | None = None, name: str = "bert") -> dict[str, Any]:
    return {"model": {"uri": uri, "format": "exported-program", "name": name}, "target": target, "sdk": sdk,
            "compiler": {"args": args if args is not None else ["-O2"]}, "buckets": buckets or ONE}


def texts(services: Services, build_id: int) -> list[str] | None:
    with services.sessions() as session:
        compared = explain_miss(session, session.get_one(Build, build_id))
    return None if compared is None else [change.text for change in compared.changes]


def test_the_miss_names_what_changed_since_the_closest_artifact(services: Services) -> None:
    submitter = Submitter(services)
    uri = upload_model(services)
    first = submitter.submit(parse_spec(neuron_spec(uri)))
    assert texts(services, first.build_id) is None  # the model's first artifact: nothing to compare with

    flags = submitter.submit(parse_spec(neuron_spec(uri, args=["-O3"])))
    assert texts(services, flags.build_id) == ["flag -O2 → -O3"]

    # Another target in between does not hide the closer artifact of the same target.
    submitter.submit(parse_spec(neuron_spec(uri, target="trn1", args=["-O1", "--auto-cast=all"])))
    sdk = submitter.submit(parse_spec(neuron_spec(uri, sdk="2.21.0", args=["-O3"])))
    found = texts(services, sdk.build_id)
    assert found is not None and found[0] == "sdk 2.20.0 → 2.21.0"
    assert any(text.startswith("neuron neuronx-cc ") and "→" in text for text in found), found
    assert not any("target" in text for text in found)

    more = submitter.submit(parse_spec(neuron_spec(uri, args=["-O3"], buckets=[*ONE, {"batch_size": 4,
                                                                                       "seq_len": 512}])))
    assert texts(services, more.build_id) == [
        "bucket input_ids: int64[4, 512], attention_mask: int64[4, 512] is new"]

    revised = submitter.submit(parse_spec(neuron_spec(upload_model(services, b"revision 2"), args=["-O3"])))
    found = texts(services, revised.build_id)
    assert found is not None and len(found) == 1 and found[0].startswith("model sha256 ")

    # A model matched by content when it has no name, and an unrelated model is never compared.
    other = submitter.submit(parse_spec(neuron_spec(upload_model(services, b"another"), name="other")))
    assert texts(services, other.build_id) is None


def test_changes_reads_each_component() -> None:
    before = {"schema": "compilesvc-key/3", "salt": "", "model": {"sha256": "a" * 64, "format": "hlo"},
              "toolchain": {"target": "inf2", "backend": "neuronx-cc", "tp_degree": 1},
              "flags": ["--auto-cast=matmult", "--model-type=transformer", "-O2"]}
    after = {**before, "salt": "rotated", "model": {"sha256": "b" * 64, "format": "hlo"},
             "toolchain": {**before["toolchain"], "tp_degree": 2},
             "flags": ["--auto-cast=all", "--enable-fast-loading-neuron-binaries", "-O2"]}
    one = [[{"name": "x", "dtype": "float32", "shape": [1, 8]}]]
    two = [[{"name": "x", "dtype": "float32", "shape": [2, 8]}]]
    found = [(c.component, c.text) for c in changes(before, one, "2.20.0", after, two, "2.20.0")]
    assert found == [
        ("salt", "the service's key salt changed (an operator disowned earlier artifacts)"),
        ("model", "model sha256 aaaaaaaaaaaa… → bbbbbbbbbbbb…"),
        ("toolchain", "tp_degree 1 → 2"),
        ("flags", "flag --auto-cast=matmult → --auto-cast=all"),
        ("flags", "flag --enable-fast-loading-neuron-binaries added"),
        ("flags", "flag --model-type=transformer removed"),
        ("buckets", "bucket x: float32[2, 8] is new"),
        ("buckets", "bucket x: float32[1, 8] dropped"),
    ]
    # The release label alone (same toolchain) changes no key, so it is not reported.
    assert changes(before, one, "2.27.0", before, one, "2.27.1") == []


def test_a_cpu_release_is_said_once_and_options_with_several_values_are_one_flag() -> None:
    base = {"schema": "compilesvc-key/3", "salt": "", "model": {"sha256": "a" * 64, "format": "torchscript"},
            "toolchain": {"target": "cpu", "backend": "torchscript", "tp_degree": 1, "sdk": "2.12.0"},
            "flags": ["--freeze"]}
    newer = {**base, "toolchain": {**base["toolchain"], "sdk": "2.13.0"}}
    assert [c.text for c in changes(base, [], "2.12.0", newer, [], "2.13.0")] == ["sdk 2.12.0 → 2.13.0"]

    pipeline = {**base, "flags": ["--pipeline", "compile", "SaveTemps", "-O2"]}
    more = {**base, "flags": ["--pipeline", "compile", "SaveTemps", "Verify", "-O2"]}
    assert [c.text for c in changes(pipeline, [], "2.13.0", more, [], "2.13.0")] == [
        "flag --pipeline compile SaveTemps → --pipeline compile SaveTemps Verify"]
    # Values reordered: the key differs, so the change is shown, whole.
    swapped = {**base, "flags": ["--pipeline", "SaveTemps", "compile", "-O2"]}
    assert [c.text for c in changes(pipeline, [], "2.13.0", swapped, [], "2.13.0")] == [
        "flag --pipeline compile SaveTemps → --pipeline SaveTemps compile"]


def test_a_schema_3_key_against_its_schema_4_key_names_the_lnc_move() -> None:
    # Key schema 4 (issue 28): the logical NeuronCore config left the flags for toolchain.lnc. An artifact made
    # under schema 3 is explained against the same spec's schema-4 key component by component.
    old = {"schema": "compilesvc-key/3", "salt": "", "model": {"sha256": "a" * 64, "format": "hlo"},
           "toolchain": {"target": "trn2", "backend": "neuronx-cc", "tp_degree": 1,
                         "neuron": {"neuronx-cc": "2.22.12471.0"}},
           "flags": ["--logical-nc-config=2", "-O2"]}
    new = {**old, "schema": "compilesvc-key/4", "toolchain": {**old["toolchain"], "lnc": 2}, "flags": ["-O2"]}
    assert [(c.component, c.text) for c in changes(old, [], "2.27.1", new, [], "2.27.1")] == [
        ("schema", "key schema compilesvc-key/3 → compilesvc-key/4"),
        ("toolchain", "lnc 2 added"),
        ("flags", "flag --logical-nc-config=2 removed"),
    ]
    lnc1 = {**new, "toolchain": {**new["toolchain"], "lnc": 1}}
    assert [c.text for c in changes(new, [], "2.27.1", lnc1, [], "2.27.1")] == ["lnc 2 → 1"]


def _nxdi_material(**changes_: Any) -> dict[str, Any]:
    material: dict[str, Any] = {
        "schema": "compilesvc-key/5", "salt": "",
        "model": {"format": "hf-checkpoint", "weights": None,
                  "config": {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64}},
        "toolchain": {"target": "trn2", "backend": "nxdi", "tp_degree": 8, "lnc": 2,
                      "neuron": {"neuronx-cc": "2.24.5133.0"}},
        "neuron_config": {"tp_degree": 8, "seq_len": 256, "batch_size": 1}, "flags": []}
    for path, value in changes_.items():
        *parents, leaf = path.split("__")
        node = material
        for parent in parents:
            node[parent] = dict(node[parent])
            node = node[parent]
        node[leaf] = value
    return material


def test_an_nxdi_miss_names_neuron_config_and_config_json_fields_one_per_line() -> None:
    base = _nxdi_material()
    tp16 = _nxdi_material(neuron_config__tp_degree=16, toolchain__tp_degree=16)
    assert [(c.component, c.text) for c in changes(base, [[]], "2.29.0", tp16, [[]], "2.29.0")] == [
        ("toolchain", "tp_degree 8 → 16"),
        ("neuron_config", "neuron_config.tp_degree 8 → 16"),
    ]
    layers = _nxdi_material(model__config__num_hidden_layers=4)
    assert [c.text for c in changes(base, [[]], "2.29.0", layers, [[]], "2.29.0")] == [
        "model.config.num_hidden_layers 2 → 4"]
    both = _nxdi_material(neuron_config__seq_len=1024, neuron_config__save_sharded_checkpoint=True,
                          model__weights={"model.safetensors": "1" * 64})
    assert [c.text for c in changes(base, [[]], "2.29.0", both, [[]], "2.29.0")] == [
        "model.weights.model.safetensors 111111111111… added",
        "neuron_config.save_sharded_checkpoint true added",
        "neuron_config.seq_len 256 → 1024",
    ]


def test_the_neuronconfig_field_a_spec_wrote_reads_alone_and_what_nxdi_derives_from_it_follows() -> None:
    # Seen: a seq_len edit read as six lines (max_context_length, max_length, n_active_tokens, n_positions,
    # pa_block_size, then seq_len): canonical_neuron_config fills NxDI's derived fields, which move with it.
    spec = {"neuron_config": {"tp_degree": 2, "batch_size": 2, "seq_len": 256, "buckets": [64, 128, 256]}}
    longer = {"neuron_config": {**spec["neuron_config"], "seq_len": 512}}
    before, after = ({**_nxdi_material(), "neuron_config": canonical_neuron_config("2.29.0", "trn2",
                                                                                   s["neuron_config"])}
                     for s in (spec, longer))
    given = given_fields(spec, longer)
    assert {"seq_len", "enable_bucketing", "context_encoding_buckets"} <= given and "buckets" not in given
    assert [c.text for c in changes(before, [[]], "2.29.0", after, [[]], "2.29.0", given)] == [
        "neuron_config.seq_len 256 → 512",
        "neuron_config fields NxDI derives from these changed with them: max_context_length 256 → 512, "
        "max_length 256 → 512, n_active_tokens 256 → 512, n_positions 256 → 512, pa_block_size 256 → 512"]
    # Without what the specs wrote (or when none of it changed: a release's new default) every field is a line.
    assert len(changes(before, [[]], "2.29.0", after, [[]], "2.29.0")) == 6
    assert len(changes(before, [[]], "2.29.0", after, [[]], "2.29.0", frozenset({"tp_degree"}))) == 6
