"""What torch prints while the cpu backends compile, sorted out: warnings about torch's own machinery that
say nothing about the user's model are silenced, each with one ``[compile-child]`` line saying what and
why (:func:`silenced`); the model's own TracerWarnings are kept, after a line explaining what they mean
for the artifact (:func:`kept_tracer_warnings`); and reads of tensor values, which torch.jit.trace bakes
in without a word, are found in the exported graph (:func:`value_reads`).

Each decision cites the torch source or documentation it rests on.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from workers.compiling.contract import log


@dataclass(frozen=True)
class HarmlessWarning:
    """A warning torch prints during a compile that the backend knows says nothing about the user's model.

    ``message`` and ``module`` are :func:`warnings.filterwarnings` regexes (matched at the start of the
    message, and of the name of the module that issues it); ``why`` is the one log line saying what is
    silenced and why, printed when the filter is installed.
    """

    category: type[Warning]
    message: str
    module: str
    why: str


#: The exported program's input guards, when traced. ``ExportedProgram.module()`` (check_guards=True, the
#: default: torch/export/exported_program.py) calls a generated ``_guards_fn`` first, which checks the
#: input shapes against the export's constraints with ``torch._assert(args[0].size()[1] == ..., "Guard
#: failed: ...")`` (torch/export/_unlift.py, _convert_guards_code_to_fn). Under torch.jit.trace those
#: sizes are traced values, so ``torch._assert``'s ``if not condition`` (torch/__init__.py) raises
#: "TracerWarning: Converting a tensor to a Python boolean might cause the trace to be incorrect". The
#: trace is of one shape bucket by design (docs: torch.jit.trace records only what runs at the example
#: inputs), the guards passed at those shapes (eager ran first), and the trace drops only the check, not
#: any computation. The filter is scoped to that warning issued by the module ``torch`` itself (where
#: ``torch._assert`` lives), so the same warning from the model's own code is still shown.
GUARDS_TRACER_WARNING = HarmlessWarning(
    torch.jit.TracerWarning,  # type: ignore[attr-defined]  # torch.jit exports it at run time, not in its stubs
    r"Converting a tensor to a Python boolean might cause the trace to be incorrect",
    r"torch\Z",
    "silenced torch's TracerWarning from the exported program's own input-shape guards (torch._assert in its "
    "_guards_fn): the trace is of this bucket's shapes, which passed the guards; it records no computation "
    "from them")

#: torch 2.13's own deprecation, printed while AOTInductor compiles: torch deep-copies its FX graph
#: (torch/_dynamo/repro/after_aot.py, ``copy.deepcopy(gm.graph)``), and rebuilding the pytree ``LeafSpec``
#: in it goes through ``LeafSpec.__new__``, which torch/utils/_pytree.py marks ``@deprecated(...,
#: category=FutureWarning)``; copyreg is where it is reported. Nothing of ours or of the model calls the
#: deprecated API: torch removed such spam in its own code (pytorch/pytorch#167470, #169421; pytorch/ao#4109
#: saw the same copyreg.py warning while lowering models). Filtered by category and exact message only: the
#: module that reports it is whichever copy machinery torch used.
LEAFSPEC_FUTURE_WARNING = HarmlessWarning(
    FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated", "",
    "silenced torch's FutureWarning '`isinstance(treespec, LeafSpec)` is deprecated': torch deep-copies its "
    "own graph while compiling; a deprecation inside torch that says nothing about the model")

#: What a TracerWarning from the model's own code means for the artifact (docs: torch.jit.trace, "Warning:
#: Tracing only correctly records functions and modules which are not data dependent").
TRACER_WARNING_EXPLAINED = (
    "the model's code turned a tensor into a Python value while traced (TracerWarning below: data-dependent "
    "control flow or indexing): the traced graph keeps what happened at this bucket's example inputs, so the "
    "artifact may compute something else for other input values. Its output matched eager torch at the "
    "example inputs only. If the model branches on tensor values, compile it with the aotinductor backend "
    "(torch.export refuses or guards such branches) or script that part (torch.jit.script)")


@contextlib.contextmanager
def silenced(harmless: Sequence[HarmlessWarning]) -> Iterator[None]:
    """Ignore exactly these warnings for the duration, saying so once each; every other warning still shows."""
    with warnings.catch_warnings():  # restores the filters afterwards: the silence ends with the call
        for known in harmless:
            warnings.filterwarnings("ignore", message=known.message, category=known.category, module=known.module)
            log(known.why)
        yield


@contextlib.contextmanager
def kept_tracer_warnings() -> Iterator[None]:
    """Show the TracerWarnings of the model's own code after one line explaining what they mean.

    They are held until the block ends (a trace takes seconds) so the explanation comes first; every
    warning held is shown as Python would have shown it, in order.
    """
    with warnings.catch_warnings(record=True) as caught:  # the current filters still decide what is caught
        try:
            yield
        finally:
            held = list(caught)
    if any(issubclass(w.category, torch.jit.TracerWarning) for w in held):  # type: ignore[attr-defined]  # as above
        log(TRACER_WARNING_EXPLAINED)
    for w in held:
        warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)


#: Graph ops that read a tensor's value into a Python number: torch.export keeps them (unbacked symbols),
#: torch.jit.trace records the number it saw as a constant, and says nothing (torch 2.13 prints no
#: TracerWarning for them).
VALUE_READS = frozenset({"aten.item.default", "aten._local_scalar_dense.default"})


def value_reads(model: torch.nn.Module) -> list[str]:
    """The nodes of an exported program's graph that read tensor values into Python numbers."""
    graph = getattr(model, "graph", None)
    if not isinstance(graph, torch.fx.Graph):
        return []
    return [node.name for node in graph.nodes if node.op == "call_function" and str(node.target) in VALUE_READS]
