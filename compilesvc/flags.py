"""Canonical compiler flags: one spelling per meaning, so equal compiles get equal keys.

Rules (documented in docs/keys.md):

- each list item is split shell-style, so ``["--auto-cast matmult"]`` equals ``["--auto-cast", "matmult"]``;
- ``--x=v`` equals ``--x v``; a token that does not start with ``-`` (or is a negative number) after a flag
  is that flag's value;
- the optimisation level has one spelling: ``-O2``, ``-O 2``, ``--optlevel 2`` and ``--optlevel=2`` become
  ``-O2``;
- other documented aliases take their long name (:data:`ALIASES`: ``-lnc 2`` and ``--lnc=2`` are
  ``--logical-nc-config=2``);
- known switches (:data:`SWITCHES`) never take the next token as their value, so a positional after them
  survives;
- a flag given twice keeps its last value (argparse semantics); exact repeats collapse;
- flags that never change the compiler's output (logs, verbosity, output and working paths, cache
  locations) are dropped;
- ``--`` ends the options: it and every token after it are kept verbatim, in order;
- the result is the positional arguments in their given order, then the flags sorted by name, then the
  ``--`` tail. Positionals go first so that the canonical form is a fixed point: after a valueless flag a
  positional would be read back as that flag's value.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable

#: Flags that only move where output/logs/caches go or how chatty the compiler is.
OUTPUT_NEUTRAL_FLAGS: frozenset[str] = frozenset(
    {
        "--logfile",
        "--logdir",
        "--verbose",
        "-v",
        "--output",
        "-o",
        "--workdir",
        "--compiler-workdir",
        "--compiler_workdir",
        "--cache_dir",
        "--cache-dir",
        "--temp-dir",
        "--tmpdir",
        "--pipeline-log",
        "--no_cache",
        "--retry_failed_compilation",
    }
)

#: neuronx-cc's other spellings of one option (its CLI reference; ``--lnc`` in its error-code pages).
ALIASES: dict[str, str] = {"-lnc": "--logical-nc-config", "--lnc": "--logical-nc-config"}

#: Flags that never take a value. Without this, ``--no_cache model.hlo`` would read the positional as the
#: flag's value and then drop both with the output-neutral flag: two different inputs, one key.
SWITCHES: frozenset[str] = frozenset({"--no_cache", "--retry_failed_compilation"})

_NEGATIVE_NUMBER = re.compile(r"^-\d+(\.\d+)?$")
_OPT_LEVEL = re.compile(r"^-O(\d)$")


class FlagError(ValueError):
    """A flag list that cannot be read (unbalanced quotes and the like)."""


def _is_flag(token: str) -> bool:
    return token.startswith("-") and token != "-" and not _NEGATIVE_NUMBER.match(token)


def _tokens(args: Iterable[str]) -> list[str]:
    out: list[str] = []
    for item in args:
        try:
            out.extend(shlex.split(item))
        except ValueError as exc:
            raise FlagError(f"cannot split compiler argument {item!r}: {exc}") from None
    return out


def canonical_flags(args: Iterable[str]) -> list[str]:
    """The canonical form of a compiler flag list (see the module docstring)."""
    tokens = _tokens(args)
    values: dict[str, str | None] = {}
    positionals: list[str] = []
    tail: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if token == "--":
            tail = tokens[i - 1 :]
            break
        if not _is_flag(token):
            positionals.append(token)
            continue
        name, sep, value = token.partition("=")
        flag_value: str | None = value if sep else None
        takes_value = not _OPT_LEVEL.match(name) and name not in SWITCHES
        if not sep and takes_value and i < len(tokens) and not _is_flag(tokens[i]):
            flag_value = tokens[i]
            i += 1
        name = ALIASES.get(name, name)
        opt = _OPT_LEVEL.match(name)
        if opt:
            name, flag_value = "--optlevel", opt.group(1)
        elif name == "-O":  # "-O 2" is argparse's other spelling of "-O2"
            name = "--optlevel"
        if name in OUTPUT_NEUTRAL_FLAGS:
            continue
        values.pop(name, None)  # last one wins, and so does its position-independent spelling
        values[name] = flag_value
    canonical = []
    for name in sorted(values):
        given = values[name]
        if name == "--optlevel" and given is not None:
            canonical.append(f"-O{given}")
        else:
            canonical.append(name if given is None else f"{name}={given}")
    return positionals + canonical + tail


def flag_names(canonical: Iterable[str]) -> set[str]:
    """The flag names (without values) of a canonical flag list; positionals are reported as-is."""
    return {flag.partition("=")[0] for flag in canonical}
