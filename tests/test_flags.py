"""Canonical compiler flags: each case pins one spelling rule from compilesvc.flags (docs/keys.md)."""

from __future__ import annotations

import pytest

from compilesvc.flags import OUTPUT_NEUTRAL_FLAGS, SWITCHES, FlagError, canonical_flags, flag_names

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
