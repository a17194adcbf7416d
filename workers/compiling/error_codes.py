"""The compiler's error codes as the SDK documents them: their families (each classified by a row of
:data:`workers.compiling.failure_table.TABLE`), and the codes its release notes call non-deterministic on some
releases, which get one more attempt before they are final (:func:`for_release`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from compilesvc.spec.neuron_releases import version_tuple
from compilesvc.states import ErrorClass
from workers.compiling.classify import Outcome


@dataclass(frozen=True)
class CodeFamily:
    """A family of the compiler's error codes, the row that classifies it, and where the family is documented."""

    prefix: str
    meaning: str
    row: str
    source: str


_RN = "aws-neuron-sdk release-notes/components/compiler.rst"
#: Every code family the SDK documents (aws-neuron-sdk at its 2.32.0 manifest, commit 81ce03ae). The error-code
#: pages (compiler/error-codes/*.rst, index.rst) list user-facing codes only, all NCC_E: ARG, BIR, BVF, HCA,
#: MOD, OOM, SFH, SPP, UOC, VRF, XSP, XTP; the release notes add NCC_ESMP002, internal NCC_I codes and
#: NCC_CFG015. ``||NCC_WRAPPER||`` in the persistent cache's log lines is a logger tag, not a code.
CODE_FAMILIES: tuple[CodeFamily, ...] = (
    CodeFamily("NCC_E", "user-facing: the model or a flag, as the compiler explains it", "ncc-error-code",
               "compiler/error-codes/index.rst (NCC_EARG001 … NCC_EXTP004); " + _RN + " 2.29.0 (NCC_ESMP002)"),
    CodeFamily("NCC_I", "internal: the compiler failing on this graph, printed as [INTERNAL_ERROR] [NCC_I…]",
               "ncc-internal-code", _RN + " 2.29.0 (NCC_INLA001), 2.30.0 (NCC_IBIR229, NCC_ILIN902, NCC_IBIR182), "
               "2.32.0 (NCC_IRPX902); aws-neuron-sdk#1303 (NCC_IXCG856)"),
    CodeFamily("NCC_CFG", "control flow graph validation", "ncc-cfg-code", _RN + " 2.29.0 (NCC_CFG015)"),
)


@dataclass(frozen=True)
class Nondeterministic:
    """Compile errors the release notes call non-deterministic: ``pattern`` codes on releases before ``fixed_in``."""

    pattern: re.Pattern[str]
    fixed_in: str
    source: str


#: Codes a release's compiler may print without the model being at fault every time. The 2.30.0 notes fixed "a
#: rare data race that could cause non-deterministic compilation failures in control flow validation", the
#: 2.31.0 notes "non-deterministic compilation failures caused by data races in control flow validation,
#: constant propagation ordering, and internal optimization heuristics"; neither names a code. Control flow
#: validation's code is NCC_CFG… (2.29.0 notes); the other two causes have no code of their own on record, so
#: no other code is suspected (retrying every internal code would double the cost of real, repeatable ones).
NONDETERMINISTIC: tuple[Nondeterministic, ...] = (
    Nondeterministic(re.compile(r"^NCC_CFG\d+$"), "2.31.0",
                     _RN + ", 2.30.0 and 2.31.0 ('non-deterministic compilation failures caused by data races "
                     "in control flow validation'); NCC_CFG is control flow graph validation (2.29.0)"),
)


def nondeterministic(code: str, sdk: str) -> str | None:
    """Why a compile error ``code`` on Neuron SDK ``sdk`` may not recur (None: it is final at once)."""
    for rule in NONDETERMINISTIC:
        if rule.pattern.match(code) and version_tuple(sdk) < version_tuple(rule.fixed_in):
            return (f"{code} may be non-deterministic before Neuron SDK {rule.fixed_in}, whose compiler fixed "
                    f"non-deterministic compilation failures in control flow validation")
    return None


def for_release(outcome: Outcome, sdk: str) -> Outcome:
    """``outcome`` of a compile for Neuron SDK ``sdk``, marked for one retry when its code is one the release
    notes call non-deterministic on that release (:data:`NONDETERMINISTIC`)."""
    if outcome.error_class != ErrorClass.COMPILE or not outcome.code:
        return outcome
    reason = nondeterministic(outcome.code, sdk)
    return replace(outcome, retry_once=reason) if reason else outcome
