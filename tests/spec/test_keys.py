"""Artifact keys: golden vectors pinned across processes and releases, and properties of what moves a key.

Golden vectors live in tests/golden/keys.json. Regenerating them is deliberate (docs/keys.md)::

    .venv/bin/python -m tests.spec.test_keys --regenerate-golden          # fills in new cases only
    .venv/bin/python -m tests.spec.test_keys --regenerate-golden --force  # also rewrites changed keys

Without ``--force`` the regeneration refuses to change an existing expected key unless ``KEY_SCHEMA`` was
bumped: a key that changes under an unchanged schema is exactly the bug the vectors exist to catch.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import random
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, get_args

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import compilesvc.spec.keys
from compilesvc.spec import neuron_releases, neuron_toolchain
from compilesvc.spec.buckets import MAX_DIM, DType
from compilesvc.spec.checkpoint import CheckpointMaterial
from compilesvc.spec.compile_spec import BACKEND_FORMATS, CPU_BACKEND_FLAGS
from compilesvc.spec.keys import KEY_SCHEMA, KeySet, canonical_json, compute_keys, digest, explain
from compilesvc.spec.parsing import parse_spec

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden" / "keys.json"
HEX64 = "0123456789abcdef" * 4

# Modest: ~35 properties run these many examples each; the whole file stays within a few seconds.
PROPERTY_SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --- golden vectors --------------------------------------------------------------------------------------

# Run in a fresh interpreter: only the public API, nothing shared with this process (hash seed included).
GOLDEN_SCRIPT = """
import json, sys
from compilesvc.spec.checkpoint import CheckpointMaterial
from compilesvc.spec.keys import compute_keys
from compilesvc.spec.parsing import parse_spec
golden = json.loads(open(sys.argv[1], encoding="utf-8").read())
skip = set(sys.argv[2:])
out = {}
for case in golden["cases"]:
    if case["name"] in skip:
        continue
    checkpoint = CheckpointMaterial.from_json(case["checkpoint"]) if "checkpoint" in case else None
    keys = compute_keys(parse_spec(case["spec"]), model_sha256=case["model_sha256"],
                        default_isa=case["isa"], salt=case["salt"], checkpoint=checkpoint)
    out[case["name"]] = {"key": keys.key, "bucket_keys": [b.key for b in keys.buckets]}
print(json.dumps(out, sort_keys=True))
"""


def nxdi_toolchain_ready() -> bool:
    """Whether the release table names NxDI's packages (``toolchain_material(sdk, "nxdi", tp)``): until it does,
    nxdi specs cannot be keyed, and their golden vectors wait (docs/keys.md, "Golden vectors")."""
    try:
        neuron_toolchain.toolchain_material("2.29.0", "nxdi", 1)
    except ValueError:
        return False
    return True


NXDI_READY = nxdi_toolchain_ready()
needs_nxdi_toolchain = pytest.mark.skipif(not NXDI_READY, reason="the release table has no NxDI versions yet "
                                          "(toolchain_material(sdk, 'nxdi', tp))")


def is_nxdi_case(case: dict[str, Any]) -> bool:
    return "checkpoint" in case


def load_golden() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(GOLDEN.read_text(encoding="utf-8"))
    return data


def keys_of_case(case: dict[str, Any]) -> KeySet:
    checkpoint = CheckpointMaterial.from_json(case["checkpoint"]) if is_nxdi_case(case) else None
    return compute_keys(parse_spec(case["spec"]), model_sha256=case["model_sha256"], default_isa=case["isa"],
                        salt=case["salt"], checkpoint=checkpoint)


def keyable(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cases this checkout can key: nxdi cases once the release table has NxDI (:func:`nxdi_toolchain_ready`)."""
    return [case for case in cases if NXDI_READY or not is_nxdi_case(case)]


def compute_golden(cases: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for case in cases:
        keys = keys_of_case(case)
        out[case["name"]] = {"key": keys.key, "bucket_keys": [b.key for b in keys.buckets]}
    return out


def expected_golden(golden: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: {"key": c["key"], "bucket_keys": c["bucket_keys"]} for c in keyable(golden["cases"])}


def test_golden_file_is_for_this_key_schema() -> None:
    golden = load_golden()
    assert golden["schema"] == KEY_SCHEMA, "KEY_SCHEMA changed: regenerate the golden vectors (docs/keys.md)"
    names = [c["name"] for c in golden["cases"]]
    assert len(names) == len(set(names)) and len(names) >= 6
    assert sum(is_nxdi_case(c) for c in golden["cases"]) >= 4
    assert all(c.get("key") for c in keyable(golden["cases"])), "a case has no expected key: regenerate (docs/keys.md)"


def test_golden_vectors_in_process() -> None:
    golden = load_golden()
    assert compute_golden(keyable(golden["cases"])) == expected_golden(golden)


def _golden_flags(name: str) -> tuple[str, list[str]]:
    case = next(c for c in load_golden()["cases"] if c["name"] == name)
    keys = compute_keys(parse_spec(case["spec"]), model_sha256=case["model_sha256"], default_isa=case["isa"],
                        salt=case["salt"])
    return keys.key, keys.material["flags"]


def test_golden_competing_flags_keep_the_right_most() -> None:
    # Schema 3: competing options are one setting, and the right-most wins (neuronx-cc's CLI reference).
    disable_key, disable_flags = _golden_flags("trn2-competing-flags-disable-right-most")
    enable_key, enable_flags = _golden_flags("trn2-competing-flags-enable-right-most")
    assert disable_flags == ["--disable-mixed-precision-accumulation", "-O1"]
    assert enable_flags == ["--enable-mixed-precision-accumulation", "-O1"]
    assert disable_key != enable_key


def test_golden_multi_value_and_dash_leading_values_are_kept_whole() -> None:
    _, flags = _golden_flags("trn2-multi-value-and-dash-leading-values")
    assert flags == [  # -lnc 2 is toolchain.lnc (schema 4), not a flag
        "--internal-hlo2tensorizer-options=--verify-hlo=true",
        "--pipeline", "compile", "SaveTemps",
        "--tensorizer-options=--enable-ccop-compute-overlap --cc-pipeline-tiling-factor=2",
    ]


def _golden(name: str) -> KeySet:
    return keys_of_case(next(c for c in load_golden()["cases"] if c["name"] == name))


def test_golden_a_neuron_key_holds_the_exact_toolchain_not_the_release_label() -> None:
    # Release manifest (aws-neuron-sdk n2-manifest.json): 2.27.0 and 2.27.1 ship identical packages, as do
    # 2.24.0 and 2.24.1; 2.26.1 ships another compiler. Same toolchain, same artifacts; another, another key.
    trace_2270 = _golden("trn1-trace-release-2.27.0-same-toolchain-as-2.27.1")
    trace_2271 = _golden("trn1-trace-release-2.27.1")
    assert trace_2270.key == trace_2271.key and trace_2270.bucket_keys == trace_2271.bucket_keys
    assert trace_2271.material["toolchain"] == {
        "target": "trn1", "backend": "trace", "tp_degree": 1, "lnc": 1,
        "neuron": {"neuronx-cc": "2.22.12471.0", "torch-neuronx": "2.9.0.2.11.19912", "libneuronxla": ["2.2.14584.0"]},
    }
    assert "sdk" not in trace_2271.material["toolchain"]
    assert _golden("trn1-trace-release-2.26.1").key != trace_2271.key
    assert _golden("trn2-hlo-release-2.24.0-same-compiler-as-2.24.1").key == _golden("trn2-hlo-release-2.24.1").key
    # tp > 1 runs neuronx-distributed too, so its version is material; an HLO compile is neuronx-cc alone.
    tp4 = _golden("trn1-trace-tp4-release-2.27.1").material["toolchain"]["neuron"]
    assert tp4["neuronx-distributed"] == "0.16.25997"
    assert _golden("trn2-hlo-release-2.24.1").material["toolchain"]["neuron"] == {"neuronx-cc": "2.19.8089.0"}


def test_golden_output_changing_environment_reaches_the_key_only_as_spec_flags() -> None:
    # A worker's NEURON_LOGICAL_NC_CONFIG / XLA_USE_BF16 never reach a compile (the worker refuses to start
    # with them, and the child's environment is an allow-list: tests/workers/host/test_toolchain.py); the spec
    # flags that say the same thing are key material and move the key.
    default = _golden("trn2-hlo-lnc-default-what-a-worker-env-cannot-change")
    lnc1 = _golden("trn2-hlo-lnc-1-the-spec-form-of-NEURON_LOGICAL_NC_CONFIG")
    bf16 = _golden("trn2-hlo-auto-cast-bf16-the-spec-form-of-XLA_USE_BF16")
    assert len({default.key, lnc1.key, bf16.key}) == 3
    assert (lnc1.material["toolchain"]["lnc"], lnc1.material["flags"]) == (1, ["-O2"])
    assert not any("environ" in name or name == "env" for name in default.material)


def test_golden_lnc_is_resolved_at_submit_and_the_default_written_out_is_the_same_key() -> None:
    # Schema 4: toolchain.lnc is the logical NeuronCore config the compile runs with: the spec's
    # --logical-nc-config (any spelling), else the target's default (2 on trn2 and trn3, 1 elsewhere).
    default = _golden("trn2-hlo-lnc-default-what-a-worker-env-cannot-change")
    assert default.material["toolchain"]["lnc"] == 2 and default.material["flags"] == ["-O2"]
    assert _golden("trn2-hlo-lnc-2-explicit-default-same-key-as-omitted").key == default.key
    trn1 = _golden("trn1-trace-release-2.27.1")
    assert trn1.material["toolchain"]["lnc"] == 1
    assert _golden("trn1-trace-lnc-1-explicit-default-same-key-as-omitted").key == trn1.key
    trn3 = _golden("trn3-hlo-release-2.29.0-lnc-default-2").material["toolchain"]
    assert (trn3["target"], trn3["lnc"], trn3["neuron"]) == ("trn3", 2, {"neuronx-cc": "2.24.5133.0"})
    assert _golden("trn3-trace-tp4-release-2.31.1-lnc-1").material["toolchain"]["lnc"] == 1
    # The lnc is a Neuron setting: cpu keys have none.
    assert "lnc" not in _golden("cpu-aotinductor-host-isa").material["toolchain"]


def test_explain_shows_the_resolved_lnc() -> None:
    lines = explain(_golden("trn2-hlo-lnc-default-what-a-worker-env-cannot-change"))
    assert any(line.startswith("  lnc         2  (") and "trn2's default" in line for line in lines)
    lines = explain(_golden("trn2-hlo-lnc-1-the-spec-form-of-NEURON_LOGICAL_NC_CONFIG"))
    assert any(line.startswith("  lnc         1  (") and "trn2's default is 2" in line for line in lines)


def test_golden_vectors_in_fresh_processes_under_several_hash_seeds() -> None:
    golden = load_golden()
    expected = expected_golden(golden)
    seeds = ["0", "1", "12345", "random"]
    procs = {}
    skipped = [c["name"] for c in golden["cases"] if c not in keyable(golden["cases"])]
    for seed in seeds:
        env = {**os.environ, "PYTHONHASHSEED": seed}
        procs[seed] = subprocess.Popen(
            [sys.executable, "-c", GOLDEN_SCRIPT, str(GOLDEN), *skipped],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    for seed, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr
        assert json.loads(stdout) == expected, f"keys differ under PYTHONHASHSEED={seed}"


def regenerate_golden(force: bool) -> int:
    """Fill in (or, deliberately, rewrite) the expected keys in tests/golden/keys.json."""
    golden = load_golden()
    actual = compute_golden(keyable(golden["cases"]))
    same_schema = golden["schema"] == KEY_SCHEMA
    changed = [
        c["name"]
        for c in keyable(golden["cases"])
        if c.get("key") and {"key": c["key"], "bucket_keys": c["bucket_keys"]} != actual[c["name"]]
    ]
    if changed and same_schema and not force:
        print(
            f"refusing: keys of {changed} changed while KEY_SCHEMA is still {KEY_SCHEMA!r}.\n"
            "Changing key material means bumping KEY_SCHEMA in compilesvc/spec/keys.py (every cached artifact\n"
            "is orphaned either way); rerun with --force only if you are sure.",
            file=sys.stderr,
        )
        return 1
    for case in golden["cases"]:
        # An nxdi case this checkout cannot key yet keeps no expected key (filled in once it can).
        case.update(actual.get(case["name"], {"key": None, "bucket_keys": []}))
    golden["schema"] = KEY_SCHEMA
    GOLDEN.write_text(json.dumps(golden, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {GOLDEN.relative_to(REPO)}: {len(golden['cases'])} cases, schema {KEY_SCHEMA}; changed: {changed}")
    return 0


# --- basic facts -----------------------------------------------------------------------------------------


def simple_spec(**overrides: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "model": {"uri": f"blob:sha256:{HEX64}", "format": "exported-program"},
        "target": "cpu",
        "sdk": "2.13.0",
        "compiler": {"backend": "aotinductor", "args": ["--max-autotune"]},
        "buckets": [{"batch_size": 1, "seq_len": 8}, {"batch_size": 2, "seq_len": 8}],
    }
    doc.update(overrides)
    return doc


def keys_of(doc: dict[str, Any], sha: str = HEX64, isa: str = "x86_64-avx512", salt: str = "") -> KeySet:
    return compute_keys(parse_spec(doc), model_sha256=sha, default_isa=isa, salt=salt)


def is_hex64(value: str) -> bool:
    return len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def test_keys_are_64_lowercase_hex() -> None:
    keys = keys_of(simple_spec())
    assert is_hex64(keys.key)
    assert all(is_hex64(b.key) for b in keys.buckets)
    assert all(is_hex64(v) for v in keys.components.values())


def test_key_schema_is_in_the_material_and_the_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = keys_of(simple_spec())
    assert keys.material["schema"] == KEY_SCHEMA
    assert KEY_SCHEMA.encode() in canonical_json(keys.material)
    assert keys.as_json()["schema"] == KEY_SCHEMA
    monkeypatch.setattr(compilesvc.spec.keys, "KEY_SCHEMA", KEY_SCHEMA + "-next")
    bumped = keys_of(simple_spec())
    assert bumped.key != keys.key
    assert not {b.key for b in bumped.buckets} & {b.key for b in keys.buckets}


def test_key_is_sha256_of_canonical_json() -> None:
    keys = keys_of(simple_spec())
    bucket_keys = sorted({b.key for b in keys.buckets})
    assert keys.key == hashlib.sha256(canonical_json({**keys.material, "buckets": bucket_keys})).hexdigest()
    assert canonical_json({"b": 1, "a": [1, "é"]}) == '{"a":[1,"é"],"b":1}'.encode()


def test_material_contents() -> None:
    keys = keys_of(simple_spec(), salt="s1")
    assert keys.material == {
        "schema": KEY_SCHEMA,
        "salt": "s1",
        "model": {"sha256": HEX64, "format": "exported-program"},
        "toolchain": {"target": "cpu", "sdk": "2.13.0", "backend": "aotinductor", "tp_degree": 1,
                      "isa": "x86_64-avx512"},
        "flags": ["--max-autotune"],
    }
    torchscript = keys_of(simple_spec(compiler={"backend": "torchscript"}))
    assert "isa" not in torchscript.material["toolchain"]


def test_explain_names_every_component() -> None:
    keys = keys_of(simple_spec(labels={"team": "x"}), salt="incident-7")
    lines = explain(keys)
    text = "\n".join(lines)
    assert lines[0] == f"artifact key  {keys.key}"
    for name in ("schema", "salt", "model", "toolchain", "flags", "buckets"):
        assert any(line.startswith(name) for line in lines), name
    for name in ("salt", "model", "toolchain", "flags", "buckets"):
        assert keys.components[name][:16] in text, name
    assert set(keys.components) == {"schema", "salt", "model", "toolchain", "flags", "buckets"}
    assert KEY_SCHEMA in text and "incident-7" in text and HEX64 in text and "--max-autotune" in text
    for bucket in keys.buckets:
        assert f"bucket[{bucket.position}] {bucket.key}" in text
    assert "team" not in text  # labels are not key material


def test_as_json_shape() -> None:
    keys = keys_of(simple_spec())
    data = keys.as_json()
    assert set(data) == {"key", "schema", "buckets", "components"}
    assert [set(b) for b in data["buckets"]] == [{"key", "inputs"}] * 2
    assert data["buckets"][0]["inputs"][0] == {"name": "input_ids", "shape": [1, 8], "dtype": "int64"}
    json.dumps(data)  # serialisable as is


def test_model_sha256_is_validated_and_case_folded() -> None:
    assert keys_of(simple_spec(), sha=HEX64.upper()).key == keys_of(simple_spec()).key
    for bad in ("", HEX64[:-1], HEX64 + "0", "g" * 64, f"sha256:{HEX64}"):
        with pytest.raises(ValueError, match="model_sha256"):
            keys_of(simple_spec(), sha=bad)


def test_unusable_default_isa_is_refused_only_where_it_matters() -> None:
    with pytest.raises(ValueError, match="ISA"):
        keys_of(simple_spec(), isa="")
    keys_of(simple_spec(compiler={"backend": "torchscript"}), isa="")  # not used, not checked


def test_a_neuron_release_the_table_does_not_know_has_no_key() -> None:
    doc = simple_spec(target="trn2", sdk="2.99.0", model={"uri": f"blob:sha256:{HEX64}", "format": "hlo"},
                      compiler={"args": []})
    spec = parse_spec(doc, extra_flags=None)  # a client's parse: the release table is the service's to check
    with pytest.raises(neuron_releases.UnknownRelease, match="neuron-releases refresh"):
        compute_keys(spec, model_sha256=HEX64, default_isa="x86_64-avx512")


def test_components_diff_explains_a_miss() -> None:
    a = keys_of(simple_spec())
    b = keys_of(simple_spec(sdk="2.13.1"))
    diff = {name for name in a.components if a.components[name] != b.components[name]}
    assert diff == {"toolchain", "buckets"}


def test_digest_is_order_independent_for_dicts() -> None:
    assert digest({"a": 1, "b": [1, 2]}) == digest({"b": [1, 2], "a": 1})
    assert digest([1, 2]) != digest([2, 1])


# --- generated specs ---------------------------------------------------------------------------------------

DTYPES: list[str] = list(get_args(DType))
NEURON_TARGETS = ["inf2", "trn1", "trn2"]
INPUT_NAMES = ["input_ids", "attention_mask", "position_ids", "pixel_values", "x", "y"]
#: neuronx-cc flags and the values each may take (None: a boolean flag). "-O" is the optlevel. All exist on
#: every release :data:`sdks` draws for neuron specs, and on every target (lnc 2 is trn2's alone).
NEURON_FLAGS: dict[str, list[str | None]] = {
    "--auto-cast": ["none", "matmult", "all"],
    "--auto-cast-type": ["bf16", "fp16", "tf32", "fp8_e4m3"],
    "--model-type": ["generic", "transformer", "unet-inference"],
    "--lnc": ["1"],
    "-O": ["1", "2", "3"],
    "--internal-backend-options": ["-1", "0.5", "7"],
    "--enable-fast-loading-neuron-binaries": [None],
    "--enable-saturate-infinity": [None],
}
#: Output-neutral flags with example values (None: given without a value).
NEUTRAL_FLAGS: list[tuple[str, str | None]] = [
    ("--logfile", "/tmp/work-1234/log-neuron-cc.txt"),
    ("--verbose", "35"),
    ("--verbose", None),
    ("--output", "/tmp/out/model.neff"),
    ("-o", "model.neff"),
    ("--workdir", "/scratch/a"),
    ("--compiler-workdir", "/scratch/b"),
    ("--cache_dir", "s3://cache/neuron"),
    ("--no_cache", None),
    ("--retry_failed_compilation", None),
]
STYLES = ["eq", "sep", "one", "short"]


@dataclass(frozen=True)
class Flag:
    name: str
    value: str | None
    style: str  # how it is spelled: --x=v | --x v (two items) | "--x v" (one item) | -O2 (optlevel only)

    def render(self) -> list[str]:
        name, value = self.name, self.value
        if name == "-O":
            if self.style == "short":
                return [f"-O{value}"]
            name = "--optlevel"
        if value is None:
            return [name]
        if self.style == "sep":
            return [name, value]
        if self.style == "one":
            return [f"{name} {value}"]
        return [f"{name}={value}"]


@dataclass(frozen=True)
class Case:
    """A generated spec plus the inputs of compute_keys; every field is one thing a user can change."""

    target: str
    sdk: str
    backend: str
    explicit_backend: bool
    format: str
    tp_degree: int
    flags: tuple[Flag, ...]
    buckets: tuple[Any, ...]  # bucket documents, shorthand or explicit
    sha: str
    default_isa: str
    salt: str
    isa: str | None = None  # compiler.isa (aotinductor only)
    uri_kind: str = "blob"
    model_name: str | None = None
    labels: dict[str, str] = field(default_factory=dict)

    def doc(self) -> dict[str, Any]:
        uri = {
            "blob": f"blob:sha256:{self.sha}",
            "s3": "s3://team-models/bert/model.pt2",
            "s3-versioned": "s3://team-models/bert/model.pt2",
            "file": "file:///models/bert/model.pt2",
        }[self.uri_kind]
        model: dict[str, Any] = {"uri": uri, "format": self.format}
        if self.uri_kind == "s3-versioned":
            model["version_id"] = "3HL4kqtJlcpXroDTDmJ.rmSpXd3dIbrHY"
        if self.model_name is not None:
            model["name"] = self.model_name
        compiler: dict[str, Any] = {"args": [item for f in self.flags for item in f.render()]}
        if self.explicit_backend:
            compiler["backend"] = self.backend
        if self.tp_degree != 1:
            compiler["tp_degree"] = self.tp_degree
        if self.isa is not None:
            compiler["isa"] = self.isa
        doc: dict[str, Any] = {
            "model": model,
            "target": self.target,
            "sdk": self.sdk,
            "compiler": compiler,
            "buckets": copy.deepcopy(list(self.buckets)),
        }
        if self.labels:
            doc["labels"] = dict(self.labels)
        return doc

    def keys(self, doc: dict[str, Any] | None = None) -> KeySet:
        spec = parse_spec(self.doc() if doc is None else doc)
        return compute_keys(spec, model_sha256=self.sha, default_isa=self.default_isa, salt=self.salt)


def expand(bucket: dict[str, Any]) -> list[dict[str, Any]]:
    """The explicit inputs a bucket document stands for (what the spec's shorthand expands to)."""
    if "inputs" in bucket:
        return copy.deepcopy(bucket["inputs"])
    shape = [bucket["batch_size"], bucket["seq_len"]]
    return [{"name": n, "shape": list(shape), "dtype": "int64"} for n in ("input_ids", "attention_mask")]


def bucket_id(bucket: dict[str, Any]) -> str:
    return json.dumps(expand(bucket), sort_keys=True)


shorthand_buckets = st.fixed_dictionaries({"batch_size": st.integers(1, 64), "seq_len": st.integers(1, 4096)})


@st.composite
def explicit_buckets(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(st.lists(st.sampled_from(INPUT_NAMES), min_size=1, max_size=3, unique=True))
    inputs = [
        {
            "name": name,
            # 2048**3 = 2**33 elements: within the default bounds per input (2**34) and per bucket (2**36),
            # even after a mutation grows a dimension by one.
            "shape": draw(st.lists(st.integers(1, 2048), max_size=3)),
            "dtype": draw(st.sampled_from(DTYPES)),
        }
        for name in names
    ]
    return {"inputs": inputs}


any_bucket = st.one_of(shorthand_buckets, explicit_buckets())
hex64 = st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)
isas = st.sampled_from(["x86_64-avx512", "x86_64-avx2", "x86_64-default", "aarch64-sve", "aarch64-neon"])
# Label keys are stripped by the spec and must stay non-empty.
label_dicts = st.dictionaries(st.text(min_size=1, max_size=8).filter(str.strip), st.text(max_size=8), max_size=3)
sdks = st.builds(
    lambda parts: ".".join(map(str, parts)), st.lists(st.integers(0, 30), min_size=3, max_size=3)
)
# Neuron flags are checked against the release: from 2.21.0 on every flag in NEURON_FLAGS exists. A Neuron
# spec's release must be in the release table (the key holds the toolchain it resolves to); these ship
# everything any backend and tp degree needs.
NEURON_RELEASES = [label for label, r in neuron_releases.table().items()
                   if neuron_releases.version_tuple(label) >= (2, 21, 0)
                   and r.trace_torch_neuronx and r.neuronx_distributed]
neuron_sdks = st.sampled_from(NEURON_RELEASES)


@st.composite
def neuron_flag_lists(draw: st.DrawFn) -> tuple[Flag, ...]:
    names = draw(st.lists(st.sampled_from(sorted(NEURON_FLAGS)), max_size=5, unique=True))
    return tuple(
        Flag(n, draw(st.sampled_from(NEURON_FLAGS[n])), draw(st.sampled_from(STYLES))) for n in names
    )


@st.composite
def cases(draw: st.DrawFn, family: str | None = None, backend: str | None = None) -> Case:
    family = family or ("cpu" if backend in ("torchscript", "aotinductor") else None)
    family = family or draw(st.sampled_from(["cpu", "neuron"]))
    # Shape-bucket compiles only: an nxdi spec (a checkpoint and a NeuronConfig) is generated by its own cases.
    backends = {name: formats for name, formats in BACKEND_FORMATS[family].items() if name != "nxdi"}
    backend = backend or draw(st.sampled_from(sorted(backends)))
    fmt = draw(st.sampled_from(sorted(backends[backend])))
    default_backend = "torchscript" if family == "cpu" else ("neuronx-cc" if fmt == "hlo" else "trace")
    if family == "cpu":
        target, tp = "cpu", 1
        allowed = sorted(CPU_BACKEND_FLAGS[backend])
        flags = tuple(Flag(n, None, "eq") for n in draw(st.lists(st.sampled_from(allowed), unique=True)))
    else:
        target, tp = draw(st.sampled_from(NEURON_TARGETS)), draw(st.integers(1, 32))
        flags = draw(neuron_flag_lists())
    buckets = draw(st.lists(any_bucket, min_size=1, max_size=4, unique_by=bucket_id))
    return Case(
        target=target,
        sdk=draw(sdks if family == "cpu" else neuron_sdks),
        backend=backend,
        explicit_backend=backend != default_backend or draw(st.booleans()),
        format=fmt,
        tp_degree=tp,
        flags=flags,
        buckets=tuple(buckets),
        sha=draw(hex64),
        default_isa=draw(isas),
        salt=draw(st.sampled_from(["", "", "incident-2025-01"])),
        isa=draw(st.one_of(st.none(), isas)) if backend == "aotinductor" else None,
        uri_kind=draw(st.sampled_from(["blob", "s3", "s3-versioned", "file"])),
        model_name=draw(st.one_of(st.none(), st.text(max_size=20))),
        labels=draw(label_dicts),
    )


@PROPERTY_SETTINGS
@given(cases())
def test_generated_specs_are_valid_and_deterministic(case: Case) -> None:
    first, second = case.keys(), case.keys()
    assert first.key == second.key and is_hex64(first.key)
    assert [b.key for b in first.buckets] == [b.key for b in second.buckets]
    assert len(first.bucket_keys) == len(case.buckets)  # distinct buckets, distinct keys


# --- compile-affecting changes move the key ---------------------------------------------------------------

Mutation = Callable[[Case, st.DataObject], Case]


def _other(data: st.DataObject, options: list[Any], current: Any) -> Any:
    choices = [o for o in options if o != current]
    assume(choices)
    return data.draw(st.sampled_from(choices))


def _bump_sdk(sdk: str) -> str:
    parts = sdk.split(".")
    parts[-1] = str(int(parts[-1]) + 1)
    return ".".join(parts)


def _toolchain(case: Case, sdk: str) -> dict[str, Any]:
    return neuron_toolchain.toolchain_material(sdk, case.backend, case.tp_degree)


def _other_sdk(case: Case, data: st.DataObject) -> Case:
    """Another release: for cpu the next torch version; for Neuron one whose toolchain differs (releases
    shipping the same packages share keys: test_releases_with_one_toolchain_share_every_key)."""
    if case.target == "cpu":
        return replace(case, sdk=_bump_sdk(case.sdk))
    others = [r for r in NEURON_RELEASES if _toolchain(case, r) != _toolchain(case, case.sdk)]
    return replace(case, sdk=data.draw(st.sampled_from(others)))


def _flag_value(case: Case, data: st.DataObject) -> Case:
    valued = [i for i, f in enumerate(case.flags) if f.value is not None and len(NEURON_FLAGS[f.name]) > 1]
    assume(valued)
    i = data.draw(st.sampled_from(valued))
    flag = case.flags[i]
    new = replace(flag, value=_other(data, NEURON_FLAGS[flag.name], flag.value))
    return replace(case, flags=(*case.flags[:i], new, *case.flags[i + 1 :]))


def _override_flag(case: Case, data: st.DataObject) -> Case:
    # The same flag again, later, with another value: the last one is the one the compiler sees.
    valued = [f for f in case.flags if f.value is not None and len(NEURON_FLAGS[f.name]) > 1]
    assume(valued)
    flag = data.draw(st.sampled_from(valued))
    later = Flag(flag.name, _other(data, NEURON_FLAGS[flag.name], flag.value), data.draw(st.sampled_from(STYLES)))
    return replace(case, flags=(*case.flags, later))


def _add_flag(case: Case, data: st.DataObject) -> Case:
    if case.target == "cpu":
        present = {f.name for f in case.flags}
        missing = sorted(CPU_BACKEND_FLAGS[case.backend] - present)
        assume(missing)
        new = Flag(data.draw(st.sampled_from(missing)), None, "eq")
    else:
        new = data.draw(st.sampled_from([Flag("--enable-fast-context-switch", None, "eq"),
                                         Flag("--distribution-strategy", "llm-training", "sep")]))
    at = data.draw(st.integers(0, len(case.flags)))
    return replace(case, flags=(*case.flags[:at], new, *case.flags[at:]))


def _with_format(case: Case, data: st.DataObject) -> Case:
    return replace(case, format=_other(data, sorted(BACKEND_FORMATS["cpu" if case.target == "cpu" else "neuron"]
                                                    [case.backend]), case.format))


def _cpu_backend(case: Case, data: st.DataObject) -> Case:
    # From a flag-free torchscript spec on a format both cpu backends take, switch to aotinductor.
    return replace(case, backend="aotinductor", explicit_backend=True)


SET_LEVEL: dict[str, tuple[st.SearchStrategy[Case], Mutation]] = {
    "model sha": (cases(), lambda c, d: replace(c, sha=("0" if c.sha[0] != "0" else "1") + c.sha[1:])),
    "format": (cases(), _with_format),
    "target": (cases(family="neuron"), lambda c, d: replace(c, target=_other(d, NEURON_TARGETS, c.target))),
    "sdk": (cases(), _other_sdk),
    "backend": (
        cases(backend="torchscript").filter(lambda c: c.format != "torchscript").map(lambda c: replace(c, flags=())),
        _cpu_backend,
    ),
    "tp degree": (cases(family="neuron"), lambda c, d: replace(c, tp_degree=c.tp_degree % 32 + 1)),
    "flag value": (cases(family="neuron"), _flag_value),
    "flag overridden later": (cases(family="neuron"), _override_flag),
    "added flag": (cases(), _add_flag),
    "salt": (cases(), lambda c, d: replace(c, salt=c.salt + "x")),
    "default isa for aotinductor": (
        cases(backend="aotinductor").map(lambda c: replace(c, isa=None)),
        lambda c, d: replace(c, default_isa=_other(d, ["x86_64-avx512", "x86_64-avx2", "aarch64-sve"], c.default_isa)),
    ),
    "explicit isa for aotinductor": (
        cases(backend="aotinductor"),
        # Against the ISA in effect: naming the host's own ISA explicitly is harmless (tested below).
        lambda c, d: replace(c, isa=_other(d, ["x86_64-avx512", "x86_64-avx2", "aarch64-neon"],
                                           c.isa or c.default_isa)),
    ),
}


@pytest.mark.parametrize("change", sorted(SET_LEVEL))
@PROPERTY_SETTINGS
@given(data=st.data())
def test_set_level_change_moves_every_key(change: str, data: st.DataObject) -> None:
    strategy, mutate = SET_LEVEL[change]
    case = data.draw(strategy, label="case")
    changed = mutate(case, data)
    before, after = case.keys(), changed.keys()
    assert after.key != before.key
    # Every bucket compiles differently now, so no bucket key may survive.
    assert not set(after.bucket_keys) & set(before.bucket_keys)


@PROPERTY_SETTINGS
@given(case=cases(family="neuron"), data=st.data())
def test_releases_with_one_toolchain_share_every_key(case: Case, data: st.DataObject) -> None:
    same = [r for r in NEURON_RELEASES if _toolchain(case, r) == _toolchain(case, case.sdk)]
    other = data.draw(st.sampled_from(same))
    before, after = case.keys(), replace(case, sdk=other).keys()
    assert after.key == before.key and after.bucket_keys == before.bucket_keys


def _explicit(case: Case, i: int) -> list[dict[str, Any]]:
    return expand(case.buckets[i])


def _set_bucket(case: Case, i: int, inputs: list[dict[str, Any]]) -> Case:
    buckets = list(case.buckets)
    buckets[i] = {"inputs": inputs}
    return replace(case, buckets=tuple(buckets))


def _shape(case: Case, i: int, data: st.DataObject) -> Case:
    inputs = _explicit(case, i)
    k = data.draw(st.integers(0, len(inputs) - 1))
    shape = inputs[k]["shape"]
    if shape:
        d = data.draw(st.integers(0, len(shape) - 1))
        shape[d] = shape[d] + 1 if shape[d] < MAX_DIM else shape[d] - 1
    else:
        shape.append(1)  # a scalar becomes a one-element vector
    return _set_bucket(case, i, inputs)


def _dtype(case: Case, i: int, data: st.DataObject) -> Case:
    inputs = _explicit(case, i)
    k = data.draw(st.integers(0, len(inputs) - 1))
    inputs[k]["dtype"] = _other(data, DTYPES, inputs[k]["dtype"])
    return _set_bucket(case, i, inputs)


def _name(case: Case, i: int, data: st.DataObject) -> Case:
    inputs = _explicit(case, i)
    k = data.draw(st.integers(0, len(inputs) - 1))
    inputs[k]["name"] = _other(data, [*INPUT_NAMES, "renamed"], inputs[k]["name"])
    assume(len({x["name"] for x in inputs}) == len(inputs))
    return _set_bucket(case, i, inputs)


def _order(case: Case, i: int, data: st.DataObject) -> Case:
    inputs = _explicit(case, i)
    assume(len(inputs) >= 2)
    return _set_bucket(case, i, inputs[::-1])


BUCKET_LEVEL: dict[str, Callable[[Case, int, st.DataObject], Case]] = {
    "shape": _shape,
    "dtype": _dtype,
    "input name": _name,
    "input order": _order,
}


@pytest.mark.parametrize("change", sorted(BUCKET_LEVEL))
@PROPERTY_SETTINGS
@given(case=cases(), data=st.data())
def test_bucket_change_moves_that_bucket_and_the_artifact_key(change: str, case: Case, data: st.DataObject) -> None:
    i = data.draw(st.integers(0, len(case.buckets) - 1), label="bucket")
    changed = BUCKET_LEVEL[change](case, i, data)
    before, after = case.keys(), changed.keys()
    assert after.buckets[i].key != before.buckets[i].key
    assert after.key != before.key
    for j in range(len(case.buckets)):
        if j != i:
            assert after.buckets[j].key == before.buckets[j].key  # only one recompile


# --- harmless changes leave the keys alone ------------------------------------------------------------------


def _shuffle_dict_order(value: Any, rng: random.Random) -> Any:
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {k: _shuffle_dict_order(v, rng) for k, v in items}
    if isinstance(value, list):
        return [_shuffle_dict_order(v, rng) for v in value]
    return value


def _respell_flags(case: Case, data: st.DataObject) -> Case:
    return replace(case, flags=tuple(replace(f, style=data.draw(st.sampled_from(STYLES))) for f in case.flags))


def _add_neutral_flags(case: Case, data: st.DataObject) -> Case:
    flags = list(case.flags)
    for name, value in data.draw(st.lists(st.sampled_from(NEUTRAL_FLAGS), min_size=1, max_size=4)):
        # Inserted between whole flags, never between a flag and its separate value.
        flags.insert(data.draw(st.integers(0, len(flags))), Flag(name, value, data.draw(st.sampled_from(STYLES))))
    return replace(case, flags=tuple(flags))


def _duplicate_flag(case: Case, data: st.DataObject) -> Case:
    assume(case.flags)
    i = data.draw(st.integers(0, len(case.flags) - 1))
    copy_ = replace(case.flags[i], style=data.draw(st.sampled_from(STYLES)))
    return replace(case, flags=(*case.flags[: i + 1], copy_, *case.flags[i + 1 :]))


def _duplicate_bucket(case: Case, data: st.DataObject) -> Case:
    bucket = data.draw(st.sampled_from(case.buckets))
    spelled = data.draw(st.sampled_from([bucket, {"inputs": expand(bucket)}]))
    at = data.draw(st.integers(0, len(case.buckets)))
    return replace(case, buckets=(*case.buckets[:at], spelled, *case.buckets[at:]))


def _explicit_shorthand(case: Case, data: st.DataObject) -> Case:
    return replace(case, buckets=tuple({"inputs": expand(b)} for b in case.buckets))


def _explicit_isa(case: Case, data: st.DataObject) -> Case:
    # Naming the ISA the host would have filled in anyway.
    return replace(case, isa=case.default_isa) if case.backend == "aotinductor" and case.isa is None else case


def _default_isa_elsewhere(case: Case, data: st.DataObject) -> Case:
    if case.backend == "aotinductor" and case.isa is None:
        return case
    return replace(case, default_isa=_other(data, ["x86_64-avx2", "aarch64-neon", "ppc64le-default"], case.default_isa))


HARMLESS: dict[str, Mutation] = {
    "labels": lambda c, d: replace(c, labels=d.draw(label_dicts)),
    "model name": lambda c, d: replace(c, model_name=d.draw(st.one_of(st.none(), st.text(max_size=30)))),
    "uri spelling": lambda c, d: replace(c, uri_kind=_other(d, ["blob", "s3", "s3-versioned", "file"], c.uri_kind)),
    "bucket order": lambda c, d: replace(c, buckets=tuple(d.draw(st.permutations(c.buckets)))),
    "flag spelling": _respell_flags,
    "flag order": lambda c, d: replace(c, flags=tuple(d.draw(st.permutations(c.flags)))),
    "output-neutral flags": _add_neutral_flags,
    "duplicate flag": _duplicate_flag,
    "duplicate bucket": _duplicate_bucket,
    "shorthand written out": _explicit_shorthand,
    "explicit default backend": lambda c, d: replace(c, explicit_backend=True),
    "explicit isa equal to the default": _explicit_isa,
    "default isa where it is not used": _default_isa_elsewhere,
}


@pytest.mark.parametrize("change", sorted(HARMLESS))
@PROPERTY_SETTINGS
@given(case=cases(), data=st.data())
def test_harmless_change_keeps_every_key(change: str, case: Case, data: st.DataObject) -> None:
    changed = HARMLESS[change](case, data)
    before, after = case.keys(), changed.keys()
    assert after.key == before.key
    assert after.bucket_keys == before.bucket_keys
    assert after.components == before.components


@PROPERTY_SETTINGS
@given(case=cases(), seed=st.integers(0, 2**32 - 1))
def test_json_dict_key_order_is_harmless(case: Case, seed: int) -> None:
    text = json.dumps(_shuffle_dict_order(case.doc(), random.Random(seed)))
    reordered = case.keys(json.loads(text))
    assert reordered.key == case.keys().key
    assert [b.key for b in reordered.buckets] == [b.key for b in case.keys().buckets]


@PROPERTY_SETTINGS
@given(case=cases(), new=any_bucket, data=st.data())
def test_adding_a_bucket_keeps_every_existing_bucket_key(case: Case, new: dict[str, Any], data: st.DataObject) -> None:
    assume(bucket_id(new) not in {bucket_id(b) for b in case.buckets})
    at = data.draw(st.integers(0, len(case.buckets)))
    grown = replace(case, buckets=(*case.buckets[:at], new, *case.buckets[at:]))
    before, after = case.keys(), grown.keys()
    assert after.key != before.key
    assert set(before.bucket_keys) < set(after.bucket_keys)
    assert len(set(after.bucket_keys) - set(before.bucket_keys)) == 1  # exactly one new compile
    assert after.buckets[at].key not in before.bucket_keys


# --- regeneration entry point ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Maintain tests/golden/keys.json (see docs/keys.md).")
    parser.add_argument("--regenerate-golden", action="store_true", required=True)
    parser.add_argument("--force", action="store_true", help="rewrite keys that changed under the same schema")
    args = parser.parse_args(argv)
    return regenerate_golden(force=args.force)


if __name__ == "__main__":
    sys.exit(main())
