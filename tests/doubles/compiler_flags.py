"""The Neuron test double's own compiler flag, declared to the service the way an operator declares one.

``--double-behaviour=<b>`` (see :mod:`tests.doubles`) is no neuronx-cc option, so a spec holding it is
refused at submit unless the service accepts it as an extra option: processes read the setting
``COMPILESVC_EXTRA_COMPILER_FLAGS`` (:data:`DOUBLE_FLAGS_SETTING`), and tests that call
:func:`compilesvc.spec.parsing.parse_spec` directly pass :data:`DOUBLE_FLAGS`. Production code knows nothing of it.
"""

from __future__ import annotations

from compilesvc.spec.neuronx_cc_options import parse_extra_flags

#: The value of ``COMPILESVC_EXTRA_COMPILER_FLAGS`` (``Settings.extra_compiler_flags``) for the double.
DOUBLE_FLAGS_SETTING = "--double-behaviour"
#: The same, as ``parse_spec(..., extra_flags=DOUBLE_FLAGS)`` takes it.
DOUBLE_FLAGS = parse_extra_flags(DOUBLE_FLAGS_SETTING)

#: An option an operator declared as extra (so the submit check lets it through) that the compiler then
#: refuses: how a ``bad_request`` failure reaches a worker once flags are checked at submit.
REJECTED_FLAG = "--no-such-flag"
#: :data:`DOUBLE_FLAGS` plus :data:`REJECTED_FLAG`.
DOUBLE_AND_REJECTED_FLAGS = parse_extra_flags(f"{DOUBLE_FLAGS_SETTING} {REJECTED_FLAG}")
