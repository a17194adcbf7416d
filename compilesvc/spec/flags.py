"""Compiler flags: their canonical form (one spelling per meaning, so equal compiles get equal keys) and the
check of a neuron spec's flags against neuronx-cc's options (:mod:`compilesvc.spec.neuronx_cc_options`).

Canonical rules (documented in docs/keys.md):

- each list item is split shell-style, so ``["--auto-cast matmult"]`` equals ``["--auto-cast", "matmult"]``;
- ``--x=v`` equals ``--x v``. How many tokens an option takes comes from the options table: a switch none,
  a one-value option the next token unless it looks like an option (a token holding a space, or a negative
  number, is a value, as argparse reads it), a several-value option (``--pipeline compile SaveTemps``) every
  token up to the next option. An option the table does not know takes the next token if it does not start
  with ``-``. A value given as ``--x=v`` is kept whole, whatever it starts with (``--tensorizer-options=--foo``);
- the optimisation level has one spelling: ``-O2``, ``-O 2``, ``--optlevel 2`` and ``--optlevel=2`` become
  ``-O2``; other aliases take the option's name (``-lnc 2`` and ``--lnc=2`` are ``--logical-nc-config=2``);
- the right-most occurrence of an option wins, and so does the right-most of competing options
  (``--enable-mixed-precision-accumulation ... --disable-mixed-precision-accumulation`` keeps only the
  disable); exact repeats collapse;
- options that never change the compiler's output (logs, verbosity, output and working paths, cache
  locations) are dropped with their values;
- ``--`` ends the options: it and every token after it are kept verbatim, in order;
- the result is the positional arguments in their given order, then the options sorted by name (a one-value
  option as ``--x=v``, a several-value option as ``--x``, ``v1``, ``v2`` items), then the ``--`` tail.
  Positionals go first, so canonicalising a canonical form of unquoted tokens gives it back (a value that
  needed quoting is written out unquoted, so a second pass may split it: keys are computed from the spec,
  never from a canonical form).

Canonicalisation never refuses a flag and never depends on settings or the SDK release: keys must agree
between hosts. :func:`check_neuron_flags` is where a neuron spec's flags are judged.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass

from compilesvc.spec import neuron_releases
from compilesvc.spec.neuron_releases import version_tuple
from compilesvc.spec.neuronx_cc_options import (
    INTERNAL_LNC_OPTION,
    LNC_OPTION,
    LNC_TARGETS,
    NEWEST_RELEASE,
    OUTPUT_NEUTRAL,
    SWITCHES,
    Arity,
    Option,
    default_lnc,
    lookup,
    nearest,
    table_release,
)

__all__ = ["OUTPUT_NEUTRAL_FLAGS", "SWITCHES", "FlagError", "FlagProblem", "canonical_flags",
           "check_neuron_flags", "flag_names", "model_builder_problems", "nxd_quoted", "uses_model_builder"]

#: Flags that only move where output/logs/caches go or how chatty the compiler is (from the options table).
OUTPUT_NEUTRAL_FLAGS: frozenset[str] = OUTPUT_NEUTRAL

_NEGATIVE_NUMBER = re.compile(r"^-\d+(\.\d+)?$")
_OPT_LEVEL = re.compile(r"^-O(\d)$")
_OPTLEVEL = "--optlevel"


class FlagError(ValueError):
    """A flag list that cannot be read (unbalanced quotes and the like)."""


@dataclass(frozen=True)
class FlagProblem:
    """Why a flag cannot be given: ``flag`` as written, ``item`` the index of the args item holding it."""

    flag: str
    item: int
    message: str


@dataclass
class _Flag:
    name: str  # canonical name (aliases resolved); the written spelling is in ``given``
    given: str
    item: int
    values: list[str] | None  # None: no value; one element unless the option takes several
    option: Option | None
    missing: bool = False  # a value was required and none followed


@dataclass
class _Parsed:
    positionals: list[tuple[str, int]]
    flags: list[_Flag]
    tail: list[str]
    tail_item: int | None


def _is_flag(token: str) -> bool:
    return token.startswith("-") and token != "-" and not _NEGATIVE_NUMBER.match(token)


def _can_be_value(token: str) -> bool:
    # argparse's reading: a "-" token with a space in it is an argument, not an option string.
    return token != "--" and (not _is_flag(token) or " " in token)


def _tokens(args: Iterable[str]) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for index, item in enumerate(args):
        try:
            out.extend((token, index) for token in shlex.split(item))
        except ValueError as exc:
            raise FlagError(f"cannot split compiler argument {item!r}: {exc}") from None
    return out


def _parse(args: Iterable[str]) -> _Parsed:
    tokens = _tokens(args)
    parsed = _Parsed([], [], [], None)
    i = 0
    while i < len(tokens):
        token, item = tokens[i]
        i += 1
        if token == "--":
            parsed.tail, parsed.tail_item = [t for t, _ in tokens[i - 1 :]], item
            break
        if not _is_flag(token):
            parsed.positionals.append((token, item))
            continue
        given, sep, value = token.partition("=")
        opt_level = _OPT_LEVEL.match(given)
        option = lookup(_OPTLEVEL if opt_level else given)
        flag = _Flag(option.name if option else given, given, item, [value] if sep else None, option)
        if opt_level:
            flag.values = [opt_level.group(1)]
        elif not sep:
            arity = option.arity if option else None
            if arity in (Arity.ONE, Arity.SEVERAL) and i < len(tokens) and _can_be_value(tokens[i][0]):
                flag.values = [tokens[i][0]]
                i += 1
            elif arity in (Arity.ONE, Arity.SEVERAL):
                flag.missing = True
            elif arity in (Arity.OPTIONAL, None) and i < len(tokens) and not _is_flag(tokens[i][0]):
                flag.values = [tokens[i][0]]
                i += 1
        if option is not None and option.arity is Arity.SEVERAL and flag.values is not None:
            while i < len(tokens) and not _is_flag(tokens[i][0]) and tokens[i][0] != "--":
                flag.values.append(tokens[i][0])
                i += 1
        parsed.flags.append(flag)
    return parsed


def canonical_flags(args: Iterable[str]) -> list[str]:
    """The canonical form of a compiler flag list (see the module docstring)."""
    parsed = _parse(args)
    slots: dict[str, _Flag] = {}
    for flag in parsed.flags:
        if flag.name in OUTPUT_NEUTRAL_FLAGS:
            continue
        slot = flag.option.slot if flag.option else flag.name
        slots.pop(slot, None)  # the right-most wins, whichever its spelling or competing name
        slots[slot] = flag
    canonical: list[str] = []
    for flag in sorted(slots.values(), key=lambda f: f.name):
        if flag.values is None:
            canonical.append(flag.name)
        elif flag.name == _OPTLEVEL:
            canonical.append(f"-O{flag.values[0]}")
        elif flag.option is not None and flag.option.arity is Arity.SEVERAL:
            canonical.extend([flag.name, *flag.values])
        else:
            canonical.append(f"{flag.name}={flag.values[0]}")
    return [p for p, _ in parsed.positionals] + canonical + parsed.tail


def flag_names(canonical: Iterable[str]) -> set[str]:
    """The flag names (without values) of a canonical flag list; positionals are reported as-is."""
    return {flag.partition("=")[0] for flag in canonical}


def _value_problem(option: Option, value: str, sdk: str, target: str) -> str | None:
    if option.value_check is not None:
        return option.value_check(value)
    if option.values is None:
        return None
    allowed = [v for v in option.values if version_tuple(v.since) <= version_tuple(table_release(sdk))
               and (v.targets is None or target in v.targets)]
    if any(v.name == value for v in allowed):
        return None
    known = next((v for v in option.values if v.name == value), None)
    if known is not None and known.targets is not None and target not in known.targets:
        return f"it is only accepted for target {', '.join(sorted(known.targets))}, not {target}"
    if known is not None:
        return f"it exists from Neuron SDK {known.since} on"
    return f"expected one of {', '.join(v.name for v in allowed)}"


def _option_problem(flag: _Flag, sdk: str, target: str, extra: frozenset[str]) -> str | None:
    option, given = flag.option, flag.given
    if option is None:
        if given in extra:
            return None
        hint = nearest(given, extra)
        newer = (f"; checked against Neuron SDK {NEWEST_RELEASE}'s options, the newest this service knows"
                 if table_release(sdk) != sdk else "")
        return f"unknown neuronx-cc option {given!r}" + (f" (did you mean {hint!r}?)" if hint else "") + newer
    if option.reserved:
        return f"{given!r} {option.reserved}; remove it from compiler.args"
    if not option.available(sdk):
        if version_tuple(table_release(sdk)) < version_tuple(option.since):
            return f"{given!r} is not available on Neuron SDK {sdk} (it exists from {option.since} on)"
        return f"{given!r} is not available on Neuron SDK {sdk} (removed in {option.until})"
    if option.targets is not None and target not in option.targets:
        return f"{given!r} is only available for target {', '.join(sorted(option.targets))}, not {target}"
    if flag.missing:
        return f"{given!r} needs a value (a value that starts with '-' is written {option.name}=VALUE)"
    if option.arity is Arity.SWITCH and flag.values is not None:
        return f"{given!r} takes no value"
    for value in flag.values or []:
        problem = _value_problem(option, value, sdk, target)
        if problem:
            return f"{given!r} does not accept {value!r}: {problem}"
    return None


def _lnc_problems(parsed: _Parsed, target: str) -> list[FlagProblem]:
    """``--internal-num-neuroncores-per-sengine`` with another value than the logical NeuronCores the compile
    runs with (the spec's ``--logical-nc-config``, else the target's default, which the service passes
    explicitly: :func:`compilesvc.spec.neuronx_cc_options.effective_lnc`): two settings of one thing that
    disagree (:data:`compilesvc.spec.neuronx_cc_options.INTERNAL_LNC_OPTION`)."""
    def last(name: str) -> _Flag | None:
        found = [f for f in parsed.flags if f.option is not None and f.option.name == name and f.values]
        return found[-1] if found else None

    internal, explicit = last(INTERNAL_LNC_OPTION), last(LNC_OPTION)
    if internal is None or not internal.values or not internal.values[0].isdigit():
        return []  # absent, or a bad value _option_problem reports
    value = int(internal.values[0])
    if explicit is not None and explicit.values and explicit.values[0].isdigit():
        lnc = int(explicit.values[0])
        if value == lnc:
            return []
        why = (f"contradicts {explicit.given} {lnc}: both set the logical NeuronCores; give only "
               f"{LNC_OPTION} (the option the service resolves, passes and keys)")
    else:
        lnc = default_lnc(target)
        if value == lnc:
            return []
        if target in LNC_TARGETS:
            why = (f"sets {value} logical NeuronCores, but a {target} compile runs with {lnc} (the target's "
                   f"default, which the service passes as {LNC_OPTION}={lnc}): write {LNC_OPTION} {value} instead")
        else:
            why = (f"sets {value} logical NeuronCores, but {target} has {lnc} (logical NeuronCores are trn2 and "
                   f"trn3's; compiler/error-codes/EARG001.rst: 'On trn1, only lnc=1 is supported')")
    return [FlagProblem(internal.given, internal.item, f"{internal.given}={value} {why}")]


#: Where a tp > 1 compile's flags go, and how they come back apart (the rule of :func:`model_builder_problems`).
MODEL_BUILDER_FLAGS_SOURCE = (
    "neuronx-distributed's ModelBuilder takes the flags as one string and never splits it (neuronx_distributed/"
    "trace/model_builder.py, v2.27.0 lines 642-651 and 720-740: it appends --logfile and hands the string to "
    "libneuronxla's neuron_xla_compile); libneuronxla splits it shell-style, which NxDI's single-quoted values "
    "rely on (neuronx_distributed_inference/models/model_wrapper.py: --tensorizer-options='...')")


#: The first neuronx-distributed whose ModelBuilder the worker traces tp > 1 with (SDK 2.21.0; the worker
#: chooses its API by it, ``workers.backends.neuron_parallel.MODEL_BUILDER_SINCE``). Before it,
#: parallel_model_trace takes the flags as a list and hands them to torch_neuronx.trace unchanged.
MODEL_BUILDER_NXD = (0, 10)


def uses_model_builder(sdk: str) -> bool:
    """Whether a tp > 1 compile for Neuron SDK ``sdk`` goes through ModelBuilder's one flags string (a release
    the table does not know, or one that ships no neuronx-distributed, is taken to)."""
    entry = neuron_releases.table().get(sdk)
    nxd = entry.neuronx_distributed if entry is not None else None
    return nxd is None or version_tuple(nxd)[:2] >= MODEL_BUILDER_NXD


def nxd_quoted(flag: str) -> str:
    """A canonical flag (``--x=v``, a switch, or a separate value) as NxDI writes it into ModelBuilder's string:
    a value that a shell-style split would change is single-quoted after ``=`` (``--x='v w'``), anything else
    is left as it is. A value holding a single quote cannot be written so (:func:`model_builder_problems`)."""
    if shlex.quote(flag) == flag:
        return flag
    name, sep, value = flag.partition("=")
    if not flag.startswith("-") or not sep:  # a separate value (or a name) is quoted whole
        return f"'{flag}'"
    return f"{name}{sep}'{value}'"


def model_builder_problems(args: Iterable[str]) -> list[FlagProblem]:
    """Values a tp > 1 compile cannot pass: those holding a single quote. ModelBuilder gets the flags as one
    string, and the form known to come back whole is NxDI's ``--x='v w'`` (:data:`MODEL_BUILDER_FLAGS_SOURCE`);
    a quote inside it would need shell escaping that nothing in NxD or NxDI relies on. Whitespace alone is fine.
    (NxD's one whitespace split, ``compiler_args.split()`` in compile_wlo, trace/functions.py:583 at v2.27.0,
    is not on ModelBuilder's path.)"""
    return [FlagProblem(flag.given, flag.item,
                        f"the value of {flag.given!r} holds a single quote, which a tp_degree > 1 compile cannot "
                        f"pass: {MODEL_BUILDER_FLAGS_SOURCE}; a value comes back whole written --x='value', with "
                        f"no quote inside")
            for flag in _parse(args).flags if any("'" in value for value in flag.values or [])]


def check_neuron_flags(args: Iterable[str], *, sdk: str, target: str,
                       extra: frozenset[str] = frozenset()) -> list[FlagProblem]:
    """Every problem neuronx-cc of Neuron SDK ``sdk`` would have with ``args`` for ``target``.

    ``extra`` names options accepted beyond the table (the ``COMPILESVC_EXTRA_COMPILER_FLAGS`` setting).
    Raises :class:`FlagError` for an item that cannot be split.
    """
    parsed = _parse(args)
    problems = []
    for value, item in parsed.positionals:
        problems.append(FlagProblem(value, item, f"{value!r} is not an option (or a value of the one before "
                                                 f"it): the service passes the model itself"))
    for flag in parsed.flags:
        message = _option_problem(flag, sdk, target, extra)
        if message:
            problems.append(FlagProblem(flag.given, flag.item, message))
    problems.extend(_lnc_problems(parsed, target))
    if parsed.tail and parsed.tail_item is not None:
        problems.append(FlagProblem("--", parsed.tail_item,
                                    "'--' would pass what follows to neuronx-cc as model files"))
    return sorted(problems, key=lambda p: p.item)
