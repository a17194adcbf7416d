"""CompileSpec validation: every refusal names its field and says what was expected."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from compilesvc.spec.buckets import (
    DEFAULT_MAX_ELEMENTS_PER_BUCKET,
    DEFAULT_MAX_ELEMENTS_PER_INPUT,
    MAX_BUCKETS,
    MAX_DIM,
    ElementLimits,
)
from compilesvc.spec.compile_spec import CompileSpec
from compilesvc.spec.keys import compute_keys
from compilesvc.spec.parsing import SpecError, load_spec_file, parse_spec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SHA = "0123456789abcdef" * 4


def neuron_doc(**overrides: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "model": {"uri": f"blob:sha256:{SHA}", "format": "torchscript"},
        "target": "inf2",
        "sdk": "2.20.0",
        "buckets": [{"batch_size": 1, "seq_len": 128}],
    }
    doc.update(overrides)
    return doc


def cpu_doc(**overrides: Any) -> dict[str, Any]:
    return neuron_doc(target="cpu", sdk="2.13.0", **overrides)


def errors(doc: Any) -> list[dict[str, str]]:
    with pytest.raises(SpecError) as info:
        parse_spec(doc)
    return info.value.errors


def assert_refused(doc: Any, field: str, fragment: str) -> None:
    """``doc`` fails with an error at exactly ``field`` whose message contains ``fragment``."""
    found = errors(doc)
    assert any(e["field"] == field and fragment in e["message"] for e in found), found


def with_path(doc: dict[str, Any], path: list[str | int], value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    target: Any = doc
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    return doc


# --- valid specs ---------------------------------------------------------------------------------------


def test_minimal_neuron_spec_defaults() -> None:
    spec = parse_spec(neuron_doc())
    assert spec.backend == "trace"
    assert spec.compiler.tp_degree == 1
    assert spec.compiler.args == []
    assert spec.labels == {}


def test_defaults_per_target_and_format() -> None:
    assert parse_spec(cpu_doc()).backend == "torchscript"
    hlo = neuron_doc(model={"uri": f"blob:sha256:{SHA}", "format": "hlo"})
    assert parse_spec(hlo).backend == "neuronx-cc"


def test_spec_is_immutable() -> None:
    spec = parse_spec(neuron_doc())
    with pytest.raises(ValueError):
        spec.sdk = "2.21.0"


@pytest.mark.parametrize(
    "uri",
    [
        f"blob:sha256:{SHA}",
        "s3://my-models/llama/model.tar",
        "s3://my.models-1/a/b/c.pt",
        "file:///abs/path/model.pt2",
    ],
)
def test_accepted_uris(uri: str) -> None:
    parse_spec(neuron_doc(model={"uri": uri, "format": "torchscript"}))


def test_version_id_allowed_with_s3() -> None:
    model = {"uri": "s3://models/m.pt", "format": "torchscript", "version_id": "3HL4kqtJlcpXroDTDmJ"}
    assert parse_spec(neuron_doc(model=model)).model.version_id == "3HL4kqtJlcpXroDTDmJ"


@pytest.mark.parametrize("sdk", ["2.20.0", "2.21.1", "2.27.1"])
def test_accepted_sdks(sdk: str) -> None:
    assert parse_spec(neuron_doc(sdk=sdk)).sdk == sdk


def test_a_neuron_release_missing_from_the_release_table_is_refused_with_the_refresh_command() -> None:
    # The key holds the exact toolchain a release resolves to (docs/keys.md): an unknown release has none.
    with pytest.raises(SpecError) as caught:
        parse_spec(neuron_doc(sdk="10.0.1"))
    assert caught.value.errors[0]["field"] == "sdk"
    assert "10.0.1" in caught.value.errors[0]["message"]
    assert "compilesvc neuron-releases refresh" in caught.value.errors[0]["message"]
    # A client leaving checks to its service (extra_flags=None) does not judge the release either.
    assert parse_spec(neuron_doc(sdk="10.0.1"), extra_flags=None).sdk == "10.0.1"


def test_a_release_newer_than_the_tables_is_refused_after_its_flags_are_checked() -> None:
    # Flags of a release newer than the flag table are checked against the newest table (a misspelt option is
    # still named); flags that pass leave the release itself, which the release table does not know.
    with pytest.raises(SpecError, match=r"release 2\.40\.0 is not in this service's release table"):
        parse_spec(flags_doc(["--native-int64=enabled", "-O2"], "2.40.0", "trn2"))


def test_trace_on_a_release_without_torch_neuronx_is_refused() -> None:
    # SDK 2.32.0's manifest lists no torch-neuronx (n2-manifest.json, manifest_version 2.32.0).
    with pytest.raises(SpecError, match="ships no torch-neuronx"):
        parse_spec(neuron_doc(sdk="2.32.0"))


def test_cpu_flag_allowlist_accepts_known_and_output_neutral_flags() -> None:
    parse_spec(cpu_doc(compiler={"args": ["--freeze", "--optimize-for-inference", "--logfile", "/tmp/l"]}))
    aot = cpu_doc(
        model={"uri": f"blob:sha256:{SHA}", "format": "exported-program"},
        compiler={"backend": "aotinductor", "args": ["--max-autotune", "--freezing"], "isa": "x86_64-avx2"},
    )
    assert parse_spec(aot).compiler.isa == "x86_64-avx2"


# --- neuron flags, checked against neuronx-cc's options for the spec's SDK and target ----------------------


def flags_doc(args: list[str], sdk: str = "2.20.0", target: str = "inf2") -> dict[str, Any]:
    # An HLO model: neuronx-cc alone, which every release in the release table ships (2.32.0 has no trace).
    return neuron_doc(sdk=sdk, target=target, compiler={"args": args},
                      model={"uri": f"blob:sha256:{SHA}", "format": "hlo"})


@pytest.mark.parametrize(
    ("args", "sdk", "target"),
    [
        (["--model-type=transformer", "-O1", "--auto-cast", "matmult", "--logfile", "/tmp/x.log"], "2.20.0", "inf2"),
        (["--enable-saturate-infinity --auto-cast=none --model-type=transformer -O1"], "2.20.0", "trn1"),
        (["-lnc", "2", "--enable-mixed-precision-accumulation", "--disable-mixed-precision-accumulation"],
         "2.27.1", "trn2"),
        (["--lnc=1"], "2.21.0", "inf2"),  # lnc 1 is the only LNC off trn2 (EARG001), and it is allowed
        (["--tensorizer-options='--enable-ccop-compute-overlap --cc-pipeline-tiling-factor=2'",
          "--internal-hlo2tensorizer-options=--verify-hlo=true", "--pipeline", "compile", "SaveTemps"],
         "2.26.1", "trn2"),
        (["--auto-cast-type", "fp8_e4m3", "--optlevel=3", "--verbose", "35", "--no_cache"], "2.20.0", "inf2"),
        (["--native-int64=enabled", "--implicit-integer-downcast=dot,pow"], "2.32.0", "trn2"),
        (["--neuroncore-pipeline-cores", "4"], "2.3.0", "trn1"),  # inf2 is a target from 2.8.0 (manifest)
    ],
)
def test_documented_neuron_flags_are_accepted(args: list[str], sdk: str, target: str) -> None:
    parse_spec(flags_doc(args, sdk, target))


@pytest.mark.parametrize(
    ("args", "sdk", "target", "field", "fragment"),
    [
        (["-O1", "--auto-cats=none"], "2.20.0", "inf2", "compiler.args[1]",
         "unknown neuronx-cc option '--auto-cats' (did you mean '--auto-cast'?)"),
        (["--enable-fast-loading-neuron-binarys"], "2.20.0", "inf2", "compiler.args[0]",
         "did you mean '--enable-fast-loading-neuron-binaries'?"),
        (["--totally-new"], "2.40.0", "inf2", "compiler.args[0]",
         "checked against Neuron SDK 2.32.0's options, the newest this service knows"),
        (["--auto-cast", "matmul"], "2.20.0", "inf2", "compiler.args[0]",
         "'--auto-cast' does not accept 'matmul': expected one of none, matmult, all"),
        (["--model-type=unet-inference"], "2.9.1", "inf2", "compiler.args[0]", "exists from Neuron SDK 2.10.0 on"),
        (["-lnc", "2"], "2.21.0", "trn1", "compiler.args[0]", "only accepted for target trn2, trn3, not trn1"),
        (["--lnc=2"], "2.20.0", "trn2", "compiler.args[0]", "'--lnc' is not available on Neuron SDK 2.20.0 "
                                                            "(it exists from 2.21.0 on)"),
        (["--disable-mixed-precision-accumulation"], "2.26.1", "inf2", "compiler.args[0]", "from 2.27.0 on"),
        (["--neuroncore-pipeline-cores=4"], "2.20.0", "inf2", "compiler.args[0]", "removed in 2.7.0"),
        (["--native-int64=enabled"], "2.32.0", "trn1", "compiler.args[0]", "only available for target trn2"),
        (["--implicit-integer-downcast=dot,matmul"], "2.32.0", "trn2", "compiler.args[0]", "not 'matmul'"),
        (["-O4"], "2.20.0", "inf2", "compiler.args[0]", "'-O4' does not accept '4'"),
        (["--auto-cast"], "2.20.0", "inf2", "compiler.args[0]", "'--auto-cast' needs a value"),
        (["--tensorizer-options", "--foo"], "2.20.0", "inf2", "compiler.args[0]",
         "a value that starts with '-' is written --tensorizer-options=VALUE"),
        (["--enable-saturate-infinity=yes"], "2.20.0", "inf2", "compiler.args[0]", "takes no value"),
        (["--target=trn1"], "2.20.0", "inf2", "compiler.args[0]", "set by the service from the spec's target"),
        (["-O1", "model.hlo"], "2.20.0", "inf2", "compiler.args[1]", "'model.hlo' is not an option"),
        (["-O1", "--", "-x"], "2.20.0", "inf2", "compiler.args[1]", "'--' would pass what follows"),
        (["--double-behaviour=ok"], "2.20.0", "inf2", "compiler.args[0]", "unknown neuronx-cc option"),
    ],
)
def test_bad_neuron_flags_are_refused_naming_the_flag(args: list[str], sdk: str, target: str, field: str,
                                                      fragment: str) -> None:
    assert_refused(flags_doc(args, sdk, target), field, fragment)


def test_every_bad_flag_is_named_in_one_error() -> None:
    found = errors(flags_doc(["-O1", "--auto-cats=none", "--optlevl=2"]))
    assert len(found) == 1 and found[0]["field"] == "compiler.args[1]"
    assert "'--auto-cats'" in found[0]["message"] and "'--optlevl'" in found[0]["message"]


def test_extra_flags_are_accepted_only_when_given() -> None:
    doc = flags_doc(["--double-behaviour=slow:1", "-O1"])
    assert parse_spec(doc, extra_flags={"--double-behaviour"}).compiler.args == ["--double-behaviour=slow:1", "-O1"]
    with pytest.raises(SpecError, match="unknown neuronx-cc option '--double-behaviour'"):
        parse_spec(doc)
    # None leaves neuron flags to the service (a client that does not share the service's settings).
    parse_spec(flags_doc(["--whatever"]), extra_flags=None)


def test_cpu_flags_are_not_checked_against_neuronx_cc() -> None:
    assert parse_spec(cpu_doc(compiler={"args": ["--freeze", "--logfile", "/tmp/x"]})).compiler.args


# --- the bucket shorthand --------------------------------------------------------------------------------


def test_shorthand_expands_to_input_ids_and_attention_mask() -> None:
    spec = parse_spec(neuron_doc(buckets=[{"batch_size": 4, "seq_len": 256}]))
    inputs = [(i.name, i.shape, i.dtype) for i in spec.buckets[0].inputs]
    assert inputs == [("input_ids", [4, 256], "int64"), ("attention_mask", [4, 256], "int64")]


def test_shorthand_equals_its_expansion() -> None:
    explicit = {
        "inputs": [
            {"name": "input_ids", "shape": [2, 64], "dtype": "int64"},
            {"name": "attention_mask", "shape": [2, 64], "dtype": "int64"},
        ]
    }
    short = parse_spec(neuron_doc(buckets=[{"batch_size": 2, "seq_len": 64}]))
    assert short == parse_spec(neuron_doc(buckets=[explicit]))


@pytest.mark.parametrize(
    ("bucket", "field", "fragment"),
    [
        ({"batch_size": 1}, "buckets[0].seq_len", "needs both batch_size and seq_len"),
        ({"seq_len": 8}, "buckets[0].batch_size", "needs both batch_size and seq_len"),
        ({"batch_size": 1, "seq_len": 8, "dtype": "int32"}, "buckets[0].dtype", "unknown field"),
        ({"batch_size": 1, "seq_len": 8, "inputs": []}, "buckets[0].inputs", "unknown field"),
        ({"batch_size": 0, "seq_len": 8}, "buckets[0].batch_size", "expected an integer from 1"),
        ({"batch_size": 1, "seq_len": MAX_DIM + 1}, "buckets[0].seq_len", "expected an integer from 1"),
        ({"batch_size": True, "seq_len": 8}, "buckets[0].batch_size", "expected an integer"),
        ({"batch_size": "4", "seq_len": 8}, "buckets[0].batch_size", "expected an integer"),
        ({"batch_size": 1.5, "seq_len": 8}, "buckets[0].batch_size", "expected an integer"),
    ],
)
def test_shorthand_errors(bucket: dict[str, Any], field: str, fragment: str) -> None:
    assert_refused(neuron_doc(buckets=[{"batch_size": 1, "seq_len": 1}, bucket]), field.replace("[0]", "[1]"),
                   fragment)


# --- unknown fields, at every level ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "field"),
    [
        (["extra"], "extra"),
        (["model", "sha256"], "model.sha256"),
        (["compiler", "flags"], "compiler.flags"),
        (["buckets", 0, "name"], "buckets[0].name"),
        (["buckets", 1, "inputs", 0, "layout"], "buckets[1].inputs[0].layout"),
    ],
)
def test_unknown_fields_are_refused_with_their_path(path: list[str | int], field: str) -> None:
    doc = neuron_doc(
        compiler={},
        buckets=[
            {"inputs": [{"name": "x", "shape": [1], "dtype": "float32"}]},
            {"inputs": [{"name": "x", "shape": [2], "dtype": "float32"}]},
        ],
    )
    assert_refused(with_path(doc, path, "surprise"), field, "unknown field")


def test_several_errors_are_all_reported() -> None:
    doc = neuron_doc(target="inf3", sdk="latest", extra=1)
    fields = {e["field"] for e in errors(doc)}
    assert fields == {"target", "sdk", "extra"}


def test_spec_error_string_names_first_field_and_counts_the_rest() -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(neuron_doc(target="inf3", sdk="latest"))
    assert str(info.value).startswith("target: ")
    assert str(info.value).endswith("(and 1 more)")


# --- field by field --------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["inf1", "INF2", "gpu", "", 2])
def test_wrong_target(target: Any) -> None:
    assert_refused(neuron_doc(target=target), "target", "Input should be")


@pytest.mark.parametrize("sdk", ["latest", "2", "2.20", "2.20.0.1", "v2.20.0", "2.20.0-rc1", "2.20.0.1.2", "", 2.2])
def test_bad_sdk(sdk: Any) -> None:
    found = errors(neuron_doc(sdk=sdk))
    assert [e["field"] for e in found] == ["sdk"], found


@pytest.mark.parametrize(
    ("uri", "fragment"),
    [
        ("blob:sha256:" + SHA.upper(), "64 lowercase hex"),
        ("blob:sha256:" + SHA[:-1], "64 lowercase hex"),
        ("blob:sha256:" + SHA + "0", "64 lowercase hex"),
        ("blob:md5:" + SHA[:32], "64 lowercase hex"),
        ("blob:" + SHA, "64 lowercase hex"),
        ("s3://models/llama/", "not a prefix"),
        ("s3://models/", "not a prefix"),
        ("s3://models", "not a prefix"),
        ("s3://Bad_Bucket/key", "not a prefix"),
        ("file://relative/path", "file:///absolute/path"),
        ("file://host/abs/path", "file:///absolute/path"),
        ("file:///abs/model.pt#v2", "file:///absolute/path"),
        ("file:///abs/model.pt?version=2", "file:///absolute/path"),
        ("https://example.com/model.pt", "expected"),
        ("/abs/path/model.pt", "expected"),
    ],
)
def test_bad_model_uri(uri: str, fragment: str) -> None:
    assert_refused(neuron_doc(model={"uri": uri, "format": "torchscript"}), "model.uri", fragment)


@pytest.mark.parametrize("uri", [f"blob:sha256:{SHA}", "file:///abs/model.pt"])
def test_version_id_only_with_s3(uri: str) -> None:
    model = {"uri": uri, "format": "torchscript", "version_id": "v1"}
    assert_refused(neuron_doc(model=model), "model.version_id", "only to s3://")


def test_bad_model_format() -> None:
    assert_refused(neuron_doc(model={"uri": f"blob:sha256:{SHA}", "format": "onnx"}), "model.format", "Input")


@pytest.mark.parametrize(
    ("doc", "field", "fragment"),
    [
        (neuron_doc(compiler={"backend": "aotinductor"}), "compiler.backend", "not available for target inf2"),
        (neuron_doc(compiler={"backend": "torchscript"}), "compiler.backend", "not available for target inf2"),
        (cpu_doc(compiler={"backend": "trace"}), "compiler.backend", "not available for target cpu"),
        (cpu_doc(compiler={"backend": "neuronx-cc"}), "compiler.backend", "not available for target cpu"),
        (neuron_doc(compiler={"backend": "gcc"}), "compiler.backend",
         "expected one of ['neuronx-cc', 'nxdi', 'trace']"),
        (
            neuron_doc(compiler={"backend": "neuronx-cc"}),
            "model.format",
            "'torchscript' cannot be compiled by backend 'neuronx-cc'",
        ),
        (
            neuron_doc(model={"uri": f"blob:sha256:{SHA}", "format": "hlo"}, compiler={"backend": "trace"}),
            "model.format",
            "'hlo' cannot be compiled by backend 'trace'",
        ),
        (cpu_doc(model={"uri": f"blob:sha256:{SHA}", "format": "hlo"}), "model.format", "cannot be compiled"),
        (cpu_doc(compiler={"backend": "aotinductor"}), "model.format", "'torchscript' cannot be compiled"),
    ],
)
def test_backend_format_target_consistency(doc: dict[str, Any], field: str, fragment: str) -> None:
    assert_refused(doc, field, fragment)


@pytest.mark.parametrize(
    ("backend", "args", "unknown"),
    [
        ("torchscript", ["--max-autotune"], "--max-autotune"),
        ("torchscript", ["-O2"], "-O2"),
        ("torchscript", ["--freeze", "--auto-cast=matmult"], "--auto-cast"),
        ("torchscript", ["model.pt"], "model.pt"),
        ("aotinductor", ["--freeze"], "--freeze"),
    ],
)
def test_cpu_flags_allowlist(backend: str, args: list[str], unknown: str) -> None:
    doc = cpu_doc(
        model={"uri": f"blob:sha256:{SHA}", "format": "exported-program"},
        compiler={"backend": backend, "args": args},
    )
    found = errors(doc)
    assert found[0]["field"] == "compiler.args", found
    assert repr(unknown) in found[0]["message"] and f"cpu {backend} backend" in found[0]["message"]


@pytest.mark.parametrize("doc", [neuron_doc, cpu_doc])
def test_unreadable_args_are_refused_with_their_index(doc: Any) -> None:
    assert_refused(doc(compiler={"args": ["--freeze", "--x 'open"]}), "compiler.args[1]", "No closing quotation")


def test_tp_degree_on_cpu() -> None:
    assert_refused(cpu_doc(compiler={"tp_degree": 2}), "compiler.tp_degree", "must be 1 for target cpu")
    assert parse_spec(cpu_doc(compiler={"tp_degree": 1})).compiler.tp_degree == 1


@pytest.mark.parametrize("tp", [0, 129, True, "2", 2.5])
def test_tp_degree_range_and_type(tp: Any) -> None:
    found = errors(neuron_doc(compiler={"tp_degree": tp}))
    assert [e["field"] for e in found] == ["compiler.tp_degree"], found


def test_integers_written_with_a_zero_fraction_are_integers() -> None:
    """JSON Schema's integer (what /openapi.json documents) includes 3.0; the spec reads it as 3."""
    spec = parse_spec(neuron_doc(compiler={"tp_degree": 2.0}))
    assert spec.compiler.tp_degree == 2 and type(spec.compiler.tp_degree) is int
    doc = cpu_doc(buckets=[{"inputs": [{"name": "x", "shape": [2, 8], "dtype": "float32"}]}])
    as_floats = copy.deepcopy(doc)
    as_floats["buckets"][0]["inputs"][0]["shape"] = [2.0, 8.0]
    assert parse_spec(as_floats) == parse_spec(doc)


def test_isa_only_for_aotinductor() -> None:
    assert_refused(cpu_doc(compiler={"isa": "x86_64-avx512"}), "compiler.isa", "only to the cpu aotinductor")
    assert_refused(neuron_doc(compiler={"isa": "x86_64-avx512"}), "compiler.isa", "only to the cpu aotinductor")


@pytest.mark.parametrize("isa", ["avx512", "x86_64_avx512", "X86_64-AVX512", "x86_64-avx512-extra"])
def test_isa_form(isa: str) -> None:
    assert_refused(cpu_doc(compiler={"isa": isa}), "compiler.isa", "expected <arch>-<isa>")


def test_duplicate_input_names() -> None:
    bucket = {
        "inputs": [
            {"name": "x", "shape": [1], "dtype": "float32"},
            {"name": "y", "shape": [1], "dtype": "float32"},
            {"name": "x", "shape": [2], "dtype": "float32"},
        ]
    }
    assert_refused(neuron_doc(buckets=[bucket]), "buckets[0].inputs[2].name", "duplicate input name 'x'")


@pytest.mark.parametrize(
    ("field_value", "field", "fragment"),
    [
        ({"name": "1x", "shape": [1], "dtype": "float32"}, "buckets[0].inputs[0].name", "Python identifier"),
        ({"name": "x" * 65, "shape": [1], "dtype": "float32"}, "buckets[0].inputs[0].name", "identifier"),
        ({"name": "x", "shape": [1], "dtype": "float64"}, "buckets[0].inputs[0].dtype", "Input should be"),
        ({"name": "x", "shape": [0], "dtype": "float32"}, "buckets[0].inputs[0].shape[0]", "greater than"),
        ({"name": "x", "shape": [MAX_DIM + 1], "dtype": "float32"}, "buckets[0].inputs[0].shape[0]", "less"),
        ({"name": "x", "shape": [1, True], "dtype": "float32"}, "buckets[0].inputs[0].shape[1]", "integer"),
        ({"name": "x", "shape": ["3"], "dtype": "float32"}, "buckets[0].inputs[0].shape[0]", "integer"),
        ({"name": "x", "shape": [3.5], "dtype": "float32"}, "buckets[0].inputs[0].shape[0]", "integer"),
        ({"name": "x", "shape": [1] * 9, "dtype": "float32"}, "buckets[0].inputs[0].shape", "at most 8"),
        ({"name": "x", "dtype": "float32"}, "buckets[0].inputs[0].shape", "Field required"),
    ],
)
def test_input_fields(field_value: dict[str, Any], field: str, fragment: str) -> None:
    assert_refused(neuron_doc(buckets=[{"inputs": [field_value]}]), field, fragment)


def test_scalar_input_has_empty_shape() -> None:
    spec = parse_spec(neuron_doc(buckets=[{"inputs": [{"name": "temperature", "shape": [], "dtype": "float32"}]}]))
    assert spec.buckets[0].inputs[0].shape == []


def _inputs(*shapes: list[int]) -> dict[str, Any]:
    return {"inputs": [{"name": f"x{i}", "shape": shape, "dtype": "bfloat16"} for i, shape in enumerate(shapes)]}


def test_a_real_llm_bucket_is_within_the_default_element_bounds() -> None:
    # input_ids [64, 32768] and hidden states [64, 32768, 8192]: 2**34 elements, the default per input.
    bucket = _inputs([64, 32768], [64, 32768, 8192])
    assert parse_spec(neuron_doc(buckets=[bucket])).buckets[0].inputs[1].shape == [64, 32768, 8192]
    assert DEFAULT_MAX_ELEMENTS_PER_INPUT == 2**34 and DEFAULT_MAX_ELEMENTS_PER_BUCKET == 2**36


@pytest.mark.parametrize(
    ("bucket", "field", "fragment"),
    [
        # The shape from the field report: 2**160 elements, which failed three compiles as "infra".
        (_inputs([1], [MAX_DIM] * 8), "buckets[1].inputs[1].shape", "at most 17179869184"),
        (_inputs([64, 32768, 8193]), "buckets[1].inputs[0].shape", "max_elements_per_input"),
        (_inputs(*[[64, 32768, 8192]] * 4, [2]), "buckets[1].inputs", "max_elements_per_bucket"),
        ({"batch_size": MAX_DIM, "seq_len": MAX_DIM}, "buckets[1]", "batch_size * seq_len"),
    ],
)
def test_element_bounds_name_the_field(bucket: dict[str, Any], field: str, fragment: str) -> None:
    doc = neuron_doc(buckets=[{"batch_size": 1, "seq_len": 8}, bucket])
    assert_refused(doc, field, fragment)
    parse_spec(doc, limits=None)  # unbounded: valid in every other way


def test_element_bounds_are_configurable_and_never_change_keys() -> None:
    doc = neuron_doc(buckets=[{"batch_size": 4, "seq_len": 512}, _inputs([8, 8, 8])])
    tight = ElementLimits(per_input=2048, per_bucket=4096)
    assert parse_spec(doc, tight).buckets[0].inputs[0].shape == [4, 512]
    cases = [
        (ElementLimits(per_input=2047, per_bucket=10**6), ["buckets[0]"]),
        (ElementLimits(per_input=2048, per_bucket=4095), ["buckets[0]"]),
        (ElementLimits(per_input=511, per_bucket=10**6), ["buckets[0]", "buckets[1].inputs[0].shape"]),
        (ElementLimits(per_input=512, per_bucket=511), ["buckets[0]", "buckets[1].inputs"]),
    ]
    for limits, fields in cases:
        with pytest.raises(SpecError) as info:
            parse_spec(doc, limits)
        assert [e["field"] for e in info.value.errors] == fields
    keys = {compute_keys(parse_spec(doc, limits), model_sha256=SHA, default_isa="x86_64-avx2").key
            for limits in (None, tight, ElementLimits())}
    assert len(keys) == 1


def test_bucket_count_limits() -> None:
    assert_refused(neuron_doc(buckets=[]), "buckets", "at least 1")
    many = [{"batch_size": 1, "seq_len": n} for n in range(1, MAX_BUCKETS + 2)]
    assert_refused(neuron_doc(buckets=many), "buckets", f"at most {MAX_BUCKETS}")
    assert_refused(neuron_doc(buckets=[{"inputs": []}]), "buckets[0].inputs", "at least 1")
    assert_refused(neuron_doc(buckets=[3]), "buckets[0]", "valid dictionary")


def test_labels() -> None:
    assert parse_spec(neuron_doc(labels={"team": "search"})).labels == {"team": "search"}
    assert_refused(neuron_doc(labels={"team": 1}), "labels.team", "expected a string, got the number 1")
    assert_refused(neuron_doc(labels={"": "x"}), 'labels[""]', "at least 1 character")
    assert_refused(neuron_doc(labels={"a" * 65: "x"}), f"labels.{'a' * 65}", "at most 64")


@pytest.mark.parametrize(("key", "field"), [("model", "model"), ("target", "target"), ("buckets", "buckets")])
def test_required_fields(key: str, field: str) -> None:
    doc = neuron_doc()
    del doc[key]
    assert_refused(doc, field, "Field required")


@pytest.mark.parametrize("document", [[], "spec", 3, None])
def test_non_object_document(document: Any) -> None:
    assert errors(document) == [{"field": "", "message": "expected a JSON object"}]


# --- files -----------------------------------------------------------------------------------------------


def test_examples_load_and_yaml_equals_json() -> None:
    as_json = load_spec_file(EXAMPLES / "tiny-bert" / "spec.json")
    as_yaml = load_spec_file(EXAMPLES / "tiny-bert" / "spec.yaml")
    assert as_json == as_yaml
    assert as_json.target == "cpu" and as_json.backend == "torchscript" and len(as_json.buckets) == 3
    llama = load_spec_file(EXAMPLES / "inf2-llama" / "spec.json")
    assert llama.target == "inf2" and llama.compiler.tp_degree == 2 and llama.backend == "trace"


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".yml", ".YAML"])
def test_load_spec_file_by_suffix(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"spec{suffix}"
    path.write_text(json.dumps(neuron_doc()))  # JSON is YAML too
    assert isinstance(load_spec_file(path), CompileSpec)


def test_yaml_block_style(tmp_path: Path) -> None:
    path = tmp_path / "spec.yml"
    path.write_text(
        f"model:\n  uri: blob:sha256:{SHA}\n  format: torchscript\ntarget: inf2\nsdk: '2.20.0'\n"
        "buckets:\n  - batch_size: 1\n    seq_len: 16\n"
    )
    assert load_spec_file(path).buckets[0].inputs[0].shape == [1, 16]


def test_yaml_unquoted_sdk_number_is_refused(tmp_path: Path) -> None:
    # YAML reads 2.20 as the float 2.2: refused, never silently turned into "2.2".
    path = tmp_path / "spec.yaml"
    path.write_text(f"model: {{uri: 'blob:sha256:{SHA}', format: torchscript}}\ntarget: inf2\nsdk: 2.20\n"
                    "buckets: [{batch_size: 1, seq_len: 1}]\n")
    with pytest.raises(SpecError) as info:
        load_spec_file(path)
    assert info.value.errors[0]["field"] == "sdk"


@pytest.mark.parametrize(
    ("name", "content", "fragment"),
    [
        ("spec.json", '{"model": ', "is not valid JSON"),
        ("spec.json", "", "is not valid JSON"),
        ("spec.yaml", "model: [\n", "is not valid YAML"),
        ("spec.yaml", "a: b\n c: d\n", "is not valid YAML"),
        ("spec.json", "[1, 2]", "expected a JSON object"),
        ("spec.yaml", "", "expected a JSON object"),
        ("spec.yaml", "- a\n- b\n", "expected a JSON object"),
    ],
)
def test_unreadable_documents(tmp_path: Path, name: str, content: str, fragment: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(SpecError) as info:
        load_spec_file(path)
    (error,) = info.value.errors
    assert error["field"] == "" and fragment in error["message"]
    assert "\n" not in error["message"]  # the CLI prints it as one line


def test_missing_and_binary_files(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"cannot read .*: No such file or directory"):
        load_spec_file(tmp_path / "absent.json")
    binary = tmp_path / "spec.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(SpecError, match="is not UTF-8 text"):
        load_spec_file(binary)
    with pytest.raises(SpecError, match="cannot read"):
        load_spec_file(tmp_path)


# What neuronx-distributed-inference passes to neuronx-cc (src/neuronx_distributed_inference/models/
# model_wrapper.py, get_compiler_args of the model classes), at each release's NxDI (v0.1.0 = SDK 2.21.0 …
# main = 2.31): the options the table had to learn, in the form NxDI writes them.
NXDI_ARGS = ["--auto-cast=none", "--model-type=transformer", "--internal-disable-fma-on-ios",
             "--disable-mixed-precision-accumulation", "--tensorizer-options='--enable-ccop-compute-overlap "
             "--cc-pipeline-tiling-factor=2 --vectorize-strided-dma '", "--lnc=2", "--hbm-scratchpad-page-size=1024",
             "--internal-backend-options='--enable-verifier=false'", "-O1",
             """--internal-dma-order-constraints='{"a": [1, 2]}'""", "--internal-bir-enable-sb-allocation",
             "--internal-enable-dge-levels", "spill_reload", "--layer-unroll-factor=4",
             "--internal-num-neuroncores-per-sengine=2", "--internal-max-instruction-limit=15000000",
             "--internal-hlo2tensorizer-options=' --modular-flow-mac-threshold=10  --verify-hlo=true'"]


def _key(args: list[str], **compiler: Any) -> str:
    doc = neuron_doc(sdk="2.27.1", target="trn2", compiler={"args": args, **compiler})
    return compute_keys(parse_spec(doc), model_sha256=SHA, default_isa="x86_64-avx2").key


def test_the_options_nxdi_passes_are_accepted_and_keyed() -> None:
    """A spec holding every option NxDI passes is accepted; each output-changing one is key material (a
    different value, a different key), and a spelling NxDI also uses (``--x v``) keys the same."""
    assert parse_spec(neuron_doc(sdk="2.27.1", target="trn2", compiler={"args": NXDI_ARGS})).compiler.args
    base = _key(NXDI_ARGS)
    assert _key([a.replace("page-size=1024", "page-size=2048") for a in NXDI_ARGS]) != base
    assert _key([a.replace("unroll-factor=4", "unroll-factor=2") for a in NXDI_ARGS]) != base
    assert _key([a for a in NXDI_ARGS if a != "--internal-disable-fma-on-ios"]) != base
    assert _key([a for a in NXDI_ARGS if a != "--internal-bir-enable-sb-allocation"]) != base
    spaced = [*NXDI_ARGS[:6], "--hbm-scratchpad-page-size", "1024", *NXDI_ARGS[7:]]
    assert _key(spaced) == base


@pytest.mark.parametrize(("flag", "hint"), [("--hbm-scratchpad-pagesize=1024", "--hbm-scratchpad-page-size"),
                                            ("--layer-unrol-factor=4", "--layer-unroll-factor"),
                                            ("--internal-disable-fma-on-io", "--internal-disable-fma-on-ios")])
def test_misspelt_nxdi_options_are_still_refused(flag: str, hint: str) -> None:
    assert_refused(neuron_doc(sdk="2.27.1", target="trn2", compiler={"args": [flag]}), "compiler.args[0]",
                   f"did you mean {hint!r}")


@pytest.mark.parametrize("flag", ["--hbm-scratchpad-page-size=0", "--layer-unroll-factor=x",
                                  "--internal-num-neuroncores-per-sengine=-1"])
def test_nxdi_options_with_counts_take_positive_integers(flag: str) -> None:
    assert_refused(neuron_doc(sdk="2.27.1", target="trn2", compiler={"args": [flag]}), "compiler.args[0]",
                   "expected a positive integer")


def test_tp_compiles_take_values_with_whitespace_as_nxdi_writes_them() -> None:
    """tp > 1 hands the flags to neuronx-distributed's ModelBuilder as one string, split again shell-style
    downstream (libneuronxla): a value with spaces passes single-quoted, as NxDI passes its own
    (models/model_wrapper.py). One that holds a single quote cannot be written that way: refused, naming it."""
    spaced = ["--auto-cast=none", "--tensorizer-options='--disable-dge --enable-ccop-compute-overlap'"]
    assert parse_spec(neuron_doc(sdk="2.27.1", compiler={"tp_degree": 2, "args": spaced})).compiler.args == spaced
    quoted = ["--auto-cast=none", '''--tensorizer-options="--x='a b'"''']
    assert_refused(neuron_doc(sdk="2.27.1", compiler={"tp_degree": 2, "args": quoted}), "compiler.args[1]",
                   "holds a single quote, which a tp_degree > 1 compile cannot pass")
    assert parse_spec(neuron_doc(sdk="2.27.1", compiler={"tp_degree": 1, "args": quoted})).compiler.args == quoted
    # 2.20 (neuronx-distributed 0.9) traces tp > 1 with parallel_model_trace, which takes the flags as a list.
    assert parse_spec(neuron_doc(sdk="2.20.0", compiler={"tp_degree": 2, "args": quoted})).compiler.args == quoted


def test_an_unquoted_yaml_release_gets_a_hint() -> None:
    assert_refused(neuron_doc(sdk=2.2), "sdk", 'put the value in quotes (sdk: "..."); unquoted, YAML reads 2.20')
