"""workers.compiling.sandbox_limits: a limit hit inside the sandbox is a SANDBOX_*_LIMIT compile error, also when the
model's own error (a compile error) is what names it; found by tests/attacks (``from_file`` past the file
size limit came out as a plain CPU_TRACE_ERROR)."""

from __future__ import annotations

from compilesvc.states import ErrorClass
from workers.compiling.classify import Outcome
from workers.compiling.sandbox_limits import limit_outcome
from workers.isolation.sandbox import Limits

LIMITS = Limits(memory_bytes=2 << 30, memory_set=True, processes=64, open_files=256, file_bytes=16 << 20,
                disk_bytes=24 << 20, tmp_bytes=16 << 20)
RESIZE = ("the model's forward fails at these input shapes: RuntimeError: unable to resize file <big.bin> to the "
          "right size: File too large (27)")


def test_a_compile_error_naming_efbig_is_the_file_size_limit() -> None:
    outcome = limit_outcome(Outcome(ErrorClass.COMPILE, "CPU_TRACE_ERROR", RESIZE), None, 1, [], LIMITS)
    assert (outcome.error_class, outcome.code) == (ErrorClass.COMPILE, "SANDBOX_FILE_SIZE_LIMIT")
    assert "COMPILESVC_SANDBOX_MAX_FILE_MB" in outcome.message


def test_a_compile_error_is_read_by_its_message_not_the_log() -> None:
    plain = Outcome(ErrorClass.COMPILE, "CPU_TRACE_ERROR", "the model's forward fails: shapes differ")
    assert limit_outcome(plain, None, 1, ["File too large", "MemoryError"], LIMITS) == plain


def test_memory_evidence_in_a_compile_error_stays_the_models() -> None:
    # Allocation failures reach here as infra (workers.compiling.model_loading.raise_if_host_trouble), never as compile.
    own = Outcome(ErrorClass.COMPILE, "CPU_TRACE_ERROR", "RuntimeError: MemoryError raised by the model itself")
    assert limit_outcome(own, None, 1, [], LIMITS) == own
