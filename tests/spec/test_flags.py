"""Canonical compiler flags: each case pins one spelling rule from compilesvc.spec.flags (docs/keys.md)."""

from __future__ import annotations

import shlex

import pytest

from compilesvc.spec.flags import (
    OUTPUT_NEUTRAL_FLAGS,
    SWITCHES,
    FlagError,
    canonical_flags,
    check_neuron_flags,
    flag_names,
    nxd_quoted,
)
from compilesvc.spec.neuron_releases import version_tuple
from compilesvc.spec.neuronx_cc_options import (
    FIRST_RELEASE,
    NEWEST_RELEASE,
    OPTIONS,
    Arity,
    effective_lnc,
    lookup,
    nearest,
    parse_extra_flags,
)

# (id, args, canonical form)
CASES: list[tuple[str, list[str], list[str]]] = [
    ("empty", [], []),
    ("equals form", ["--auto-cast=matmult"], ["--auto-cast=matmult"]),
    ("space form, two items", ["--auto-cast", "matmult"], ["--auto-cast=matmult"]),
    ("space form, one item split shell-style", ["--auto-cast matmult"], ["--auto-cast=matmult"]),
    ("extra whitespace inside an item", ["  --auto-cast    matmult  "], ["--auto-cast=matmult"]),
    ("quoted value keeps its space", ["--opt 'a b'"], ["--opt=a b"]),
    ("quoted value, equals form", ['--opt="a b"'], ["--opt=a b"]),
    ("boolean flag", ["--enable-fast-loading-neuron-binaries"], ["--enable-fast-loading-neuron-binaries"]),
    ("sorted by flag name", ["--b=1", "--a=2"], ["--a=2", "--b=1"]),
    ("exact duplicate collapses", ["--auto-cast=all", "--auto-cast=all"], ["--auto-cast=all"]),
    ("last value wins", ["--auto-cast=all", "--auto-cast", "none"], ["--auto-cast=none"]),
    ("last wins across spellings", ["--auto-cast none", "--auto-cast=matmult"], ["--auto-cast=matmult"]),
    ("-O2", ["-O2"], ["-O2"]),
    ("-O 2", ["-O", "2"], ["-O2"]),
    ("--optlevel 2", ["--optlevel", "2"], ["-O2"]),
    ("--optlevel=2", ["--optlevel=2"], ["-O2"]),
    ("optlevel: last spelling wins", ["-O1", "--optlevel=3"], ["-O3"]),
    ("-O1 does not swallow a value", ["-O1", "matmult"], ["matmult", "-O1"]),
    ("negative number is a value", ["--shift", "-1"], ["--shift=-1"]),
    ("negative decimal is a value", ["--scale -0.5"], ["--scale=-0.5"]),
    ("negative value, equals form", ["--shift=-1"], ["--shift=-1"]),
    ("a flag is not a value", ["--a", "--b"], ["--a", "--b"]),
    ("value containing =", ["--define=k=v"], ["--define=k=v"]),
    ("empty value differs from no value", ["--x="], ["--x="]),
    ("positionals first, in order", ["--a=1", "z.hlo", "-O2", "a.hlo"], ["z.hlo", "a.hlo", "--a=1", "-O2"]),
    ("positional after a valueless flag", ["--a", "-O2", "z.hlo"], ["z.hlo", "--a", "-O2"]),
    ("-- ends the options, tail verbatim", ["--b", "--", "--a", "x"], ["--b", "--", "--a", "x"]),
    ("lone dash is positional", ["-"], ["-"]),
    ("positionals keep their order", ["b", "a"], ["b", "a"]),
    # Output-neutral flags, with and without values, in every spelling: gone.
    ("drop --logfile value", ["--logfile", "/tmp/x.log", "-O1"], ["-O1"]),
    ("drop --logfile=value", ["--logfile=/work/abs/log-neuron-cc.txt"], []),
    ("drop --logfile in one item", ["--logfile /tmp/x.log"], []),
    ("drop --verbose level", ["--verbose", "35", "--auto-cast=none"], ["--auto-cast=none"]),
    ("drop --verbose bare", ["--verbose", "--auto-cast=none"], ["--auto-cast=none"]),
    ("drop --output", ["--output", "model.neff"], []),
    ("drop -o", ["-o", "model.neff"], []),
    ("drop working dirs", ["--workdir=/a", "--compiler-workdir", "/b", "--compiler_workdir=/c"], []),
    ("drop cache dirs", ["--cache_dir=s3://b/c", "--cache-dir", "/d"], []),
    ("drop log dir and temp dir", ["--logdir", "/l", "--temp-dir=/t", "--tmpdir", "/u"], []),
    ("drop --pipeline-log", ["--pipeline-log=x"], []),
    # Switches never take a value, so a positional after them survives their removal.
    ("--no_cache is a switch", ["--no_cache", "a.hlo"], ["a.hlo"]),
    ("negative number positional", ["-O1", "-3"], ["-3", "-O1"]),
    ("--retry_failed_compilation is a switch", ["--retry_failed_compilation", "b.hlo"], ["b.hlo"]),
    (
        "neuronx-distributed defaults",
        ["--enable-saturate-infinity --auto-cast=none --model-type=transformer -O1"],
        ["--auto-cast=none", "--enable-saturate-infinity", "--model-type=transformer", "-O1"],
    ),
]


@pytest.mark.parametrize(("args", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_canonical_form(args: list[str], expected: list[str]) -> None:
    assert canonical_flags(args) == expected


@pytest.mark.parametrize(("args", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_canonical_form_is_a_fixed_point(args: list[str], expected: list[str]) -> None:
    # Canonicalising twice changes nothing (shlex-quoting each item so values with spaces survive the split).
    import shlex

    assert canonical_flags([shlex.quote(item) for item in expected]) == expected


# Groups of spellings that must canonicalise identically.
EQUIVALENT: list[list[list[str]]] = [
    [["--auto-cast=matmult"], ["--auto-cast", "matmult"], ["--auto-cast matmult"], ["--auto-cast  matmult "]],
    [["-O2"], ["-O", "2"], ["--optlevel", "2"], ["--optlevel=2"], ["-O1", "-O2"]],
    # neuronx-cc's documented aliases; a later spelling overrides an earlier one, whichever the spelling.
    [["--logical-nc-config=2"], ["-lnc", "2"], ["--lnc", "2"], ["--lnc=2"], ["--logical-nc-config=1", "-lnc=2"]],
    [
        ["--model-type=transformer", "-O1"],
        ["-O1", "--model-type", "transformer"],
        ["--model-type=transformer", "-O1", "--logfile", "/tmp/a.log", "--verbose", "info"],
        ["--output=x.neff", "--model-type=transformer", "--model-type=transformer", "-O1"],
    ],
]


@pytest.mark.parametrize("spellings", EQUIVALENT)
def test_equivalent_spellings(spellings: list[list[str]]) -> None:
    forms = {tuple(canonical_flags(s)) for s in spellings}
    assert len(forms) == 1, forms


# Pairs that must stay different: merging them would hand out a wrong artifact.
DIFFERENT: list[tuple[list[str], list[str]]] = [
    (["-O1"], ["-O2"]),
    (["--lnc", "1"], ["--lnc", "2"]),
    (["--auto-cast=matmult"], ["--auto-cast=all"]),
    (["--auto-cast=matmult"], []),
    (["--x"], ["--x="]),
    (["--no_cache", "a.hlo"], ["--no_cache", "b.hlo"]),
    (["a", "b"], ["b", "a"]),
    (["--", "--a"], ["--a"]),
    (["--shift", "-1"], ["--shift", "1"]),
]


@pytest.mark.parametrize(("a", "b"), DIFFERENT)
def test_different_meanings_stay_different(a: list[str], b: list[str]) -> None:
    assert canonical_flags(a) != canonical_flags(b)


@pytest.mark.parametrize("item", ["--x 'unbalanced", '--x "open', "--x=\\"])
def test_unbalanced_quote_is_a_flag_error(item: str) -> None:
    with pytest.raises(FlagError, match="cannot split compiler argument"):
        canonical_flags(["-O1", item])


def test_flag_error_is_a_value_error() -> None:
    # pydantic turns ValueErrors raised in validators into field errors; FlagError must be one.
    assert issubclass(FlagError, ValueError)


def test_flag_names() -> None:
    assert flag_names(canonical_flags(["--freeze", "--auto-cast=all", "-O1", "pos"])) == {
        "--freeze",
        "--auto-cast",
        "-O1",
        "pos",
    }


def test_every_output_neutral_flag_is_dropped() -> None:
    for flag in sorted(OUTPUT_NEUTRAL_FLAGS):
        assert canonical_flags([flag, "-O1"]) == ["-O1"], flag
        assert canonical_flags([f"{flag}=value", "-O1"]) == ["-O1"], flag
        # A switch leaves the next token alone (a positional); any other flag takes it as its value.
        expected = ["value", "-O1"] if flag in SWITCHES else ["-O1"]
        assert canonical_flags([flag, "value", "-O1"]) == expected, flag


# --- driven by neuronx-cc's options table (compilesvc.spec.neuronx_cc_options) -------------------------------------

TABLE_CASES: list[tuple[str, list[str], list[str]]] = [
    ("disable right-most wins",
     ["--enable-mixed-precision-accumulation", "-O1", "--disable-mixed-precision-accumulation"],
     ["--disable-mixed-precision-accumulation", "-O1"]),
    ("enable right-most wins", ["--disable-mixed-precision-accumulation", "--enable-mixed-precision-accumulation"],
     ["--enable-mixed-precision-accumulation"]),
    ("competing pair in one item", ["--enable-mixed-precision-accumulation --disable-mixed-precision-accumulation"],
     ["--disable-mixed-precision-accumulation"]),
    ("several values kept whole and in order", ["--pipeline", "compile", "SaveTemps", "-O1"],
     ["-O1", "--pipeline", "compile", "SaveTemps"]),
    ("several values in one item", ["--pipeline compile SaveTemps"], ["--pipeline", "compile", "SaveTemps"]),
    ("several values, equals form", ["--pipeline=compile SaveTemps"], ["--pipeline", "compile", "SaveTemps"]),
    ("several values: last occurrence wins", ["--pipeline a b", "--pipeline c"], ["--pipeline", "c"]),
    ("dash-leading value, equals form", ["--tensorizer-options=--foo"], ["--tensorizer-options=--foo"]),
    ("quoted dash-leading value with a space", ["--tensorizer-options='--foo --bar'"],
     ["--tensorizer-options=--foo --bar"]),
    ("quoted dash-leading value, separate token", ["--tensorizer-options '--foo --bar'"],
     ["--tensorizer-options=--foo --bar"]),
    ("nested equals kept", ["--internal-hlo2tensorizer-options=--verify-hlo=true"],
     ["--internal-hlo2tensorizer-options=--verify-hlo=true"]),
    ("switch never takes a value", ["--enable-saturate-infinity", "x.hlo"], ["x.hlo", "--enable-saturate-infinity"]),
    ("known switch is not confused by a later option", ["--enable-fast-context-switch", "--auto-cast", "none"],
     ["--auto-cast=none", "--enable-fast-context-switch"]),
]


@pytest.mark.parametrize(("args", "expected"), [c[1:] for c in TABLE_CASES], ids=[c[0] for c in TABLE_CASES])
def test_table_driven_canonical_form(args: list[str], expected: list[str]) -> None:
    assert canonical_flags(args) == expected
    import shlex

    assert canonical_flags([shlex.quote(item) for item in expected]) == expected  # a fixed point


def test_every_alias_takes_its_options_name() -> None:
    for option in OPTIONS:
        for alias in option.aliases:
            value = option.values[-1].name if option.values else "1"
            canonical = canonical_flags([alias, value])
            assert canonical == canonical_flags([option.name, value]), alias


def test_table_rows_are_consistent() -> None:
    seen: set[str] = set()
    for option in OPTIONS:
        names = {option.name, *option.aliases}
        assert not names & seen, names  # one meaning per spelling
        seen |= names
        assert option.source, option.name
        assert version_tuple(FIRST_RELEASE) <= version_tuple(option.since) <= version_tuple(NEWEST_RELEASE), option.name
        if option.until is not None:
            assert version_tuple(option.since) < version_tuple(option.until), option.name
        if option.arity is Arity.SWITCH:
            assert option.values is None and option.value_check is None, option.name
        assert not (option.values and option.value_check), option.name
    groups: dict[str, list[str]] = {}
    for option in OPTIONS:
        if option.group:
            groups.setdefault(option.group, []).append(option.name)
    assert groups == {"mixed-precision-accumulation": ["--enable-mixed-precision-accumulation",
                                                       "--disable-mixed-precision-accumulation"]}


def test_newer_release_uses_the_newest_table() -> None:
    assert lookup("--native-int64") is not None
    option = lookup("--native-int64")
    assert option is not None and option.available("2.40.0") and not option.available("2.31.1")
    removed = lookup("--neuroncore-pipeline-cores")
    assert removed is not None and removed.available("2.6.0") and not removed.available("2.40.0")


@pytest.mark.parametrize(("name", "expected"), [("--auto-cats", "--auto-cast"), ("--optlevle", "--optlevel"),
                                                ("--logical-nc-confg", "--logical-nc-config"), ("--zzz", None)])
def test_nearest_name(name: str, expected: str | None) -> None:
    assert nearest(name) == expected


def test_check_reports_each_problem_with_its_item() -> None:
    problems = check_neuron_flags(["-O1", "--auto-cast matmul", "--lnc=2"], sdk="2.27.1", target="trn1")
    assert [(p.flag, p.item) for p in problems] == [("--auto-cast", 1), ("--lnc", 2)]
    assert check_neuron_flags(["--x=1"], sdk="2.27.1", target="trn1", extra=frozenset({"--x"})) == []


@pytest.mark.parametrize("text", ["--a,--b", "--a --b", " --a ,\n--b "])
def test_extra_flags_setting(text: str) -> None:
    assert parse_extra_flags(text) == {"--a", "--b"}


@pytest.mark.parametrize("text", ["a", "--a=1", "--a,-"])
def test_extra_flags_setting_refuses_non_names(text: str) -> None:
    with pytest.raises(ValueError, match="expected option names"):
        parse_extra_flags(text)


@pytest.mark.parametrize(("flag", "written"), [
    ("-O1", "-O1"), ("--auto-cast=none", "--auto-cast=none"), ("--internal-disable-fma-on-ios",
                                                                "--internal-disable-fma-on-ios"),
    ("--tensorizer-options=--a --b", "--tensorizer-options='--a --b'"),
    ('--internal-dma-order-constraints={"a": [1]}', """--internal-dma-order-constraints='{"a": [1]}'"""),
    ("--x=", "--x="), ("compile SaveTemps", "'compile SaveTemps'"),
])
def test_nxd_quoted_writes_values_as_nxdi_does(flag: str, written: str) -> None:
    """ModelBuilder's one string: values a shell-style split would change are single-quoted after '=', as NxDI
    writes them (models/model_wrapper.py); the split gives the flag back."""
    assert nxd_quoted(flag) == written
    assert shlex.split(nxd_quoted(flag)) == [flag]


# --internal-num-neuroncores-per-sengine: NxDI 2.21's way of setting the logical NeuronCores (model_wrapper.py
# at NXDI@v0.1.0), --lnc from NxDI 2.22. It may only agree with the LNC the compile runs with.

@pytest.mark.parametrize(("args", "item", "said"), [
    (["--logical-nc-config", "2", "--internal-num-neuroncores-per-sengine", "1"], 2,
     "contradicts --logical-nc-config 2"),
    (["-lnc", "2", "--internal-num-neuroncores-per-sengine=1"], 2, "contradicts -lnc 2"),
    (["--lnc=1", "--internal-num-neuroncores-per-sengine=2"], 1, "contradicts --lnc 1"),
])
def test_an_internal_lnc_contradicting_the_logical_nc_config_is_refused_naming_it(args: list[str], item: int,
                                                                                   said: str) -> None:
    for target in ("trn2", "trn3"):
        (problem,) = check_neuron_flags(args, sdk="2.29.0", target=target)
        assert (problem.flag, problem.item) == ("--internal-num-neuroncores-per-sengine", item)
        assert said in problem.message and "give only --logical-nc-config" in problem.message


def test_an_internal_lnc_alone_resolves_the_lnc_logical_nc_config_would_or_is_refused_with_a_pointer() -> None:
    from tests.spec.test_compile_spec import assert_refused, neuron_doc

    agreeing = ["--internal-num-neuroncores-per-sengine=2"]  # trn2's default: what the service passes anyway
    assert check_neuron_flags(agreeing, sdk="2.27.1", target="trn2") == []
    assert effective_lnc("trn2", canonical_flags(agreeing))[0] == \
        effective_lnc("trn2", canonical_flags(["--logical-nc-config=2"]))[0] == 2
    assert check_neuron_flags(["--lnc", "1", "--internal-num-neuroncores-per-sengine", "1"], sdk="2.27.1",
                              target="trn2") == []  # both say 1: LNC 1, as --lnc 1 alone
    (problem,) = check_neuron_flags(["--internal-num-neuroncores-per-sengine=1"], sdk="2.27.1", target="trn2")
    assert "a trn2 compile runs with 2" in problem.message and "write --logical-nc-config 1 instead" in problem.message
    assert check_neuron_flags(["--internal-num-neuroncores-per-sengine=1"], sdk="2.21.0", target="trn1") == []
    (problem,) = check_neuron_flags(["--internal-num-neuroncores-per-sengine=2"], sdk="2.21.0", target="trn1")
    assert "trn1 has 1" in problem.message and "EARG001" in problem.message
    # Through the spec, as the API answers it (a 422 naming the item).
    doc = neuron_doc(sdk="2.27.1", target="trn2",
                     compiler={"args": ["-O2", "--internal-num-neuroncores-per-sengine=1"]})
    assert_refused(doc, "compiler.args[1]", "--internal-num-neuroncores-per-sengine=1 sets 1 logical NeuronCores")
