"""neuronx-cc's command-line options, per Neuron SDK release: the data behind flag canonicalisation and checks.

Each :class:`Option` row says how the compiler reads an option (its aliases and arity), which values it takes
where the SDK's docs enumerate them, whether it changes the compiled output, which options compete with it
(right-most wins), from which release on it exists (and until when), and for which targets. Rows cite their
source. :mod:`compilesvc.spec.flags` reads this table; nothing here parses a command line.

Sources (aws-neuron/aws-neuron-sdk, cited by path below):

- CLI: ``compiler/neuronx-cc/api-reference-guide/neuron-compiler-cli-reference-guide.rst`` (SDK 2.3.0-2.26),
  ``compiler/neuronx-cc/api-reference-guide/index.rst`` (2.27-2.32). "CLI@2.x" below names the release
  whose version of that page first lists the option.
- RN: ``release-notes/components/compiler.rst``; compiler versions map to SDK releases through
  ``src/helperscripts/n2-manifest.json`` (e.g. compiler 2.10.0.34 shipped with SDK 2.14.0).

Releases outside the table: a spec for a release newer than :data:`NEWEST_RELEASE` is checked against the
newest table (options are assumed to stay; the error says so), because refusing every new release until this
file is updated would block all its users. Operators can accept options this table lacks with the setting
``COMPILESVC_EXTRA_COMPILER_FLAGS`` (:func:`parse_extra_flags`). A release older than an option's ``since``
does not have it, so a release before :data:`FIRST_RELEASE` has no options at all.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from compilesvc.spec.neuron_releases import version_tuple

#: The first SDK release with neuronx-cc's CLI reference (CLI@2.3.0; compiler 2.1.0.76 per the manifest).
FIRST_RELEASE = "2.3.0"
#: The newest SDK release this table was checked against (CLI@2.32.0, compiler 2.27.5334.0).
NEWEST_RELEASE = "2.32.0"

_CLI_OLD = "aws-neuron-sdk compiler/neuronx-cc/api-reference-guide/neuron-compiler-cli-reference-guide.rst"
_CLI = "aws-neuron-sdk compiler/neuronx-cc/api-reference-guide/index.rst"
_RN = "aws-neuron-sdk release-notes/components/compiler.rst"
_NXDI = "aws-neuron/neuronx-distributed-inference models (get_compiler_args); optimum-neuron modeling_decoder.py"
_MW = "aws-neuron/neuronx-distributed-inference src/neuronx_distributed_inference/models/model_wrapper.py"
_WRAPPER = ("torch-neuronx's NEURON_CC_FLAGS wrapper options (aws-neuron-sdk frameworks/torch/torch-neuronx "
            "persistent cache docs): read by the wrapper, never by the neuronx-cc CLI")
_LEGACY = "compilesvc key schema 2's output-neutral list (undocumented; dropped before any compiler sees it)"


class Arity(StrEnum):
    """How many command-line tokens an option takes after its name (``--x=v`` always gives one value)."""

    SWITCH = "switch"  # never a value
    ONE = "one"  # exactly one value, required
    OPTIONAL = "optional"  # a value if the next token is not an option
    SEVERAL = "several"  # one or more values, up to the next option (``--pipeline compile SaveTemps``)


@dataclass(frozen=True)
class Value:
    """One documented value of an option: from which release on, and for which targets (None: all)."""

    name: str
    since: str = FIRST_RELEASE
    targets: frozenset[str] | None = None


@dataclass(frozen=True)
class Option:
    name: str
    arity: Arity
    source: str
    aliases: tuple[str, ...] = ()
    #: The documented values (None: not enumerated; any value passes).
    values: tuple[Value, ...] | None = None
    #: A check for values the docs describe by form rather than by list; returns a problem or None.
    value_check: Callable[[str], str | None] | None = None
    changes_output: bool = True
    #: Options that set the same thing share a group; the right-most one on the command line wins.
    group: str | None = None
    since: str = FIRST_RELEASE
    until: str | None = None  # the first release without it
    targets: frozenset[str] | None = None
    #: Set by the service itself: the spec may not give it (the message says why).
    reserved: str | None = None

    @property
    def slot(self) -> str:
        """What the option sets: competing options share one slot."""
        return self.group or self.name

    def available(self, sdk: str) -> bool:
        have = version_tuple(table_release(sdk))
        return version_tuple(self.since) <= have and (self.until is None or have < version_tuple(self.until))


def _v(*names: str, since: str = FIRST_RELEASE, targets: frozenset[str] | None = None) -> tuple[Value, ...]:
    return tuple(Value(name, since, targets) for name in names)


_INTEGER_DOWNCAST_OPS = ("dot", "scatter", "all_reduce", "reduce_scatter", "pow")


def _integer_downcast(value: str) -> str | None:
    # CLI@2.32.0: default | all | none | a comma-separated list of dot, scatter, all_reduce, reduce_scatter, pow.
    if value in ("default", "all", "none"):
        return None
    ops = value.split(",")
    unknown = [op for op in ops if op not in _INTEGER_DOWNCAST_OPS]
    if not unknown:
        return None
    return (f"expected default, all, none or a comma-separated list of {', '.join(_INTEGER_DOWNCAST_OPS)} "
            f"(not {', '.join(map(repr, unknown))})")


def _positive_int(value: str) -> str | None:
    return None if value.isdigit() and int(value) > 0 else "expected a positive integer"


#: Targets with logical NeuronCores (LNC 1 or 2), and the compiler's default there: 2. Sources: the CLI
#: reference (``--logical-nc-config``: "Only available on trn2; Default: 2"); about-neuron/arch/neuron-features/
#: logical-neuroncore-config.rst ("LNC applies only to Trn2 and Trn3 instances", LNC=2 the default on Trn2);
#: trn3's default is not written in the compiler's pages: neuronx-distributed ``utils/model_utils.py``
#: ``get_platform_lnc`` and NxDI ``models/config.py`` ``get_platform_lnc`` give 2 on trn2 and trn3, 1 elsewhere.
#: Since compilesvc passes the resolved value to the compiler explicitly (:func:`effective_lnc`), the
#: compiler's own trn3 default never decides an artifact. Elsewhere only 1 (compiler/error-codes/EARG001.rst:
#: "On trn1, only lnc=1 is supported").
LNC_TARGETS = frozenset({"trn2", "trn3"})
#: "trn2 and later" in the CLI reference (``--native-int64``: "Only available on trn2 and later").
TRN2_AND_LATER = frozenset({"trn2", "trn3"})
LNC_OPTION = "--logical-nc-config"
#: The undocumented option NxDI 2.21 set the logical NeuronCores with (model_wrapper.py at NXDI@v0.1.0,
#: L106-L140: "--internal-num-neuroncores-per-sengine={logical_neuron_cores}"), replaced from NxDI 2.22 by
#: ``--lnc`` with the same value (docs/research/nxdi.md, "Per-release differences"). No public page says how
#: neuronx-cc combines it with ``--logical-nc-config``, so a spec may give it only with the value the compile
#: runs with anyway (:func:`effective_lnc`; compilesvc.spec.flags refuses any other value): it can never
#: contradict the ``--logical-nc-config`` the service passes, and the resolved LNC (in the key) is its value.
INTERNAL_LNC_OPTION = "--internal-num-neuroncores-per-sengine"

OPTIONS: tuple[Option, ...] = (
    # --- set by the service -------------------------------------------------------------------------------
    # Its values are the spec's target: inf2, trn1, trn2 and (SDK examples, NKI docs, compiler notes 2.29-2.32)
    # trn3, each from the first release whose manifest lists it (compilesvc.spec.neuron_kinds.release_targets).
    Option("--target", Arity.ONE, f"{_CLI_OLD} (CLI@2.3.0)",
           reserved="is set by the service from the spec's target"),
    Option("--framework", Arity.ONE, f"{_CLI_OLD} (CLI@2.3.0)",
           reserved="is set by the service (XLA for hlo models; trace sets its own)"),
    # --- documented options that change the output -------------------------------------------------------
    Option("--model-type", Arity.ONE, f"{_CLI_OLD} (CLI@2.3.0); unet-inference: {_RN} (compiler 2.6.0.19 = SDK "
           "2.10.0)", values=(*_v("generic", "transformer"), *_v("unet-inference", since="2.10.0"))),
    # CLI@2.3.0 lists the value as "matmul" under a "(Default: matmult)" heading; every later page and the
    # 2.27 release notes spell it matmult, which is the spelling accepted here.
    Option("--auto-cast", Arity.ONE, f"{_CLI_OLD} (CLI@2.3.0); {_CLI}", values=_v("none", "matmult", "all")),
    Option("--auto-cast-type", Arity.ONE, f"{_CLI_OLD} (CLI@2.3.0); fp8_e4m3: {_RN} (compiler 2.5.0.28 = SDK "
           "2.9.0)", values=(*_v("bf16", "fp16", "tf32"), *_v("fp8_e4m3", since="2.9.0"))),
    Option("--optlevel", Arity.ONE, f"{_RN} (compiler 2.10.0.34 = SDK 2.14.0); {_CLI}", aliases=("-O",),
           values=_v("1", "2", "3"), since="2.14.0"),
    Option("--enable-experimental-O1", Arity.SWITCH, f"{_RN} (compiler 2.4.0.21 = SDK 2.7.0; deprecated by "
           "--optlevel in compiler 2.10.0.34, removal announced but not dated)", since="2.7.0"),
    Option("--num-parallel-jobs", Arity.ONE, f"{_RN} (compiler 2.4.0.21 = SDK 2.7.0). Not documented as "
           "output-neutral, so it stays in the key: a false miss costs a compile, a false hit a wrong binary",
           value_check=_positive_int, since="2.7.0"),
    Option("--neuroncore-pipeline-cores", Arity.ONE, f"{_CLI_OLD} (CLI@2.3.0; gone from CLI@2.7.0)",
           value_check=_positive_int, until="2.7.0"),
    Option("--distribution-strategy", Arity.ONE, f"{_CLI_OLD} (CLI@2.10.0); llm-training: {_RN} (compiler "
           "2.11.0.34 = SDK 2.15.0), 'equivalent to the previously documented NEMO' (CLI@2.32.0)",
           values=(*_v("NEMO", since="2.10.0"), *_v("llm-training", since="2.15.0")), since="2.10.0"),
    Option("--enable-saturate-infinity", Arity.SWITCH, f"{_RN} (compiler 2.7.0.40 = SDK 2.11.0)", since="2.11.0"),
    # Competing pair: CLI@2.32.0 "If multiple competing options are specified then the option right-most on
    # the command line will supercede previous options."
    Option("--enable-mixed-precision-accumulation", Arity.SWITCH, f"{_RN} (compiler 2.13.66.0 = SDK 2.18.0)",
           group="mixed-precision-accumulation", since="2.18.0"),
    Option("--disable-mixed-precision-accumulation", Arity.SWITCH, "aws-neuron-sdk release-notes/prev/2.27.0/"
           "compiler.rst ('the new --disable-mixed-precision-accumulation flag')",
           group="mixed-precision-accumulation", since="2.27.0"),
    Option("--enable-fast-context-switch", Arity.SWITCH, f"{_CLI_OLD} (CLI@2.3.0)"),
    Option("--enable-fast-loading-neuron-binaries", Arity.SWITCH, f"{_CLI_OLD} (CLI@2.3.0)"),
    # "-lnc" (CLI@2.21.0) and "--lnc" (compiler/error-codes/EARG001.rst, which also says "On trn1, only lnc=1
    # is supported", so 2 is refused off trn2). CLI: "Only available on trn2; Default: 2".
    Option("--logical-nc-config", Arity.ONE, f"{_RN} (Neuron 2.21.0 Beta); {_CLI}; compiler/error-codes/"
           "EARG001.rst", aliases=("-lnc", "--lnc"), values=(Value("1"), Value("2", targets=LNC_TARGETS)),
           since="2.21.0"),
    Option("--native-int64", Arity.ONE, f"{_RN} (Neuron 2.32.0); {_CLI} ('Only available on trn2 and later')",
           values=_v("default", "enabled", "disabled"), since="2.32.0", targets=TRN2_AND_LATER),
    Option("--implicit-integer-downcast", Arity.ONE, f"{_RN} (Neuron 2.32.0); {_CLI}",
           value_check=_integer_downcast, since="2.32.0"),
    # --- undocumented options that the SDK's own libraries pass ------------------------------------------
    # Availability by release is unknown: accepted from the first release. Their values are handed to inner
    # compiler passes and often start with "-" (write them --name=VALUE or quoted).
    Option("--tensorizer-options", Arity.ONE, _NXDI),
    Option("--internal-hlo2tensorizer-options", Arity.ONE, _NXDI),
    Option("--internal-max-instruction-limit", Arity.ONE, _NXDI, value_check=_positive_int),
    Option("--internal-enable-dge-levels", Arity.ONE, _NXDI),
    Option("--internal-backend-options", Arity.ONE, "aws-neuron-sdk nki/deep-dives/src/mxfp-matmul/mx_toplevel.py"),
    Option("--internal-compiler-debug-mode", Arity.ONE,
           "aws-neuron-sdk nki/deep-dives/src/mxfp-matmul/mx_toplevel.py"),
    Option("--pipeline", Arity.SEVERAL, "aws-neuron-sdk nki/deep-dives/src/mxfp-matmul/mx_toplevel.py "
           "('--pipeline compile SaveTemps')"),
    # What NxDI's models/model_wrapper.py adds to every decoder's flags, read at each release's NxDI (tags
    # v0.1.0 = SDK 2.21.0 … v0.7.14366 = 2.27.0, main = 2.31). All change what is generated (memory layout,
    # unrolling, DMA and fused-multiply-add choices), so all stay in the key.
    Option("--hbm-scratchpad-page-size", Arity.ONE, f"{_MW} v0.1.0-main ('--hbm-scratchpad-page-size="
           "{scratchpad_page_size}', 1024 in mllama)", value_check=_positive_int),
    Option("--layer-unroll-factor", Arity.ONE, f"{_MW} v0.4.7422-v0.7.14366 ('--layer-unroll-factor=4')",
           value_check=_positive_int),
    Option("--internal-num-neuroncores-per-sengine", Arity.ONE, f"{_MW} v0.1.0 ('--internal-num-neuroncores-"
           "per-sengine={logical_neuron_cores}', replaced by --lnc in v0.2.0)", value_check=_positive_int),
    Option("--internal-disable-fma-on-ios", Arity.SWITCH, f"{_MW} v0.4.7422-main (long-context mode)"),
    Option("--internal-dma-order-constraints", Arity.ONE, f"{_MW} main (\"--internal-dma-order-constraints="
           "'{json}'\", a JSON value)"),
    Option("--internal-bir-enable-sb-allocation", Arity.SWITCH, f"{_MW} main (with --internal-dma-order-"
           "constraints)"),
    # --- output-neutral: dropped from the key and from what the compiler is given --------------------------
    Option("--logfile", Arity.ONE, f"{_CLI_OLD} (CLI@2.3.0)", changes_output=False),
    Option("--output", Arity.ONE, f"{_CLI_OLD} (CLI@2.3.0)", changes_output=False),
    # CLI lists info|warning|error|critical|debug, and torch-neuronx itself passes --verbose=35; as it never
    # reaches the compiler from a spec, its value is not checked.
    Option("--verbose", Arity.OPTIONAL, f"{_CLI_OLD} (CLI@2.3.0)", changes_output=False),
    Option("--cache_dir", Arity.ONE, _WRAPPER, changes_output=False),
    Option("--no_cache", Arity.SWITCH, _WRAPPER, changes_output=False),
    Option("--retry_failed_compilation", Arity.SWITCH, _WRAPPER, changes_output=False),
    *(Option(name, Arity.OPTIONAL, _LEGACY, changes_output=False)
      for name in ("--logdir", "-v", "-o", "--workdir", "--compiler-workdir", "--compiler_workdir", "--cache-dir",
                   "--temp-dir", "--tmpdir", "--pipeline-log")),
)

#: Every name and alias -> its option.
BY_NAME: dict[str, Option] = {name: o for o in OPTIONS for name in (o.name, *o.aliases)}
#: Names of the options that never change the output (dropped by canonicalisation).
OUTPUT_NEUTRAL: frozenset[str] = frozenset(name for name, o in BY_NAME.items() if not o.changes_output)
#: Names of the options that never take a value.
SWITCHES: frozenset[str] = frozenset(name for name, o in BY_NAME.items() if o.arity is Arity.SWITCH)


def default_lnc(target: str) -> int:
    """The logical NeuronCore config a compile for ``target`` gets when no ``--logical-nc-config`` is given."""
    return 2 if target in LNC_TARGETS else 1


def effective_lnc(target: str, canonical: list[str]) -> tuple[int, list[str]]:
    """The logical NeuronCore config a compile of ``canonical`` flags (:func:`compilesvc.spec.flags.
    canonical_flags`, aliases resolved, right-most kept) for ``target`` runs with, and the flags without it.

    The spec's ``--logical-nc-config`` if it has one, else the target's default: a spec that writes the
    default gets the value (and so the key) of one that omits it. A value that is not a number (refused at
    submit) is left in the flags for the compiler to refuse.
    """
    prefix = LNC_OPTION + "="
    end = canonical.index("--") if "--" in canonical else len(canonical)  # the "--" tail is verbatim
    options, tail = canonical[:end], canonical[end:]
    given = [flag for flag in options if flag.startswith(prefix)]
    if given and given[-1][len(prefix):].isdigit():
        return int(given[-1][len(prefix):]), [flag for flag in options if not flag.startswith(prefix)] + tail
    return default_lnc(target), list(canonical)


def lookup(name: str) -> Option | None:
    """The option spelled ``name`` (its name or an alias), if the table knows it."""
    return BY_NAME.get(name)


def table_release(sdk: str) -> str:
    """The release whose options apply to ``sdk``: itself, or the newest known for a newer one."""
    return sdk if version_tuple(sdk) <= version_tuple(NEWEST_RELEASE) else NEWEST_RELEASE


def nearest(name: str, extra: frozenset[str] = frozenset()) -> str | None:
    """The known option name closest to a misspelt ``name``, if any is close."""
    matches = difflib.get_close_matches(name, [*BY_NAME, *extra], n=1, cutoff=0.7)
    return matches[0] if matches else None


_EXTRA_NAME = re.compile(r"^--?[A-Za-z0-9][A-Za-z0-9_.-]*$")


def parse_extra_flags(text: str) -> frozenset[str]:
    """Option names from the setting ``COMPILESVC_EXTRA_COMPILER_FLAGS`` (comma- or space-separated).

    These are accepted in addition to the table, with any value or none, and kept in the key. Raises
    ValueError for something that is not an option name.
    """
    names = frozenset(part for part in re.split(r"[,\s]+", text.strip()) if part)
    bad = sorted(n for n in names if not _EXTRA_NAME.match(n))
    if bad:
        raise ValueError(f"expected option names such as --my-option, got {', '.join(map(repr, bad))}")
    return names
