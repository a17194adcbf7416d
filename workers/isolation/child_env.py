"""The compiler child's environment: an explicit allow-list, and the variables a worker refuses to start with.

Key material comes from the spec alone (docs/keys.md). A variable in the worker's environment that changes
what the compiler writes would change artifacts without changing keys, so each such variable is either
dropped before the child starts or refused when the worker starts; nothing else reaches the compiler.

The child gets (:func:`child_environment`) exactly:

- :data:`ALLOWED` names: the process basics (``PATH``, ``HOME``, locale, ``TMPDIR``, ``PYTHONPATH`` …, where
  the toolchain is and how text is decoded), thread counts, ``TORCH_HOME`` and ``TORCHINDUCTOR_CACHE_DIR``
  (paths), ``COMPILESVC_NEURON_SDK`` (the child refuses a
  request for another release), and ``NEURON_CC_FLAGS``, which may hold only output-neutral flags (cache,
  log and verbosity settings), checked at worker start;
- :data:`ALLOWED_PREFIXES`: ``LC_*`` (locale), ``NEURON_RT_*`` (the runtime's device, core and log
  settings: where and how a NEFF runs, not what the compiler writes), ``COMPILESVC_NEURON_DEVICE_GLOB``
  (the operator setting for where device nodes appear) and the Neuron TEST DOUBLE's own knobs
  (``COMPILESVC_NEURON_DOUBLE_*``, read by nothing else);
- minus any name that looks like a secret (:data:`SECRET_MARKERS`), even under an allowed prefix;
- plus what the runner sets per compile (``NEURON_PLATFORM_TARGET_OVERRIDE`` = the request's target,
  ``PYTHONUNBUFFERED``).

Everything else is dropped: the service's settings and credentials (``COMPILESVC_*``, ``AWS_*``: the
runner fetches the model, the child needs no S3), a worker-level ``NEURON_PLATFORM_TARGET_OVERRIDE`` (the
request's target replaces it), other ``NEURON_*`` / ``XLA_*`` / ``TORCH*`` variables (``XLA_FLAGS``,
``TORCHINDUCTOR_MAX_AUTOTUNE``, … change what is generated and are not in the key).

Refused at worker start (:func:`output_changing_problems`; the message names where the setting belongs):
``NEURON_LOGICAL_NC_CONFIG`` (same meaning as ``--lnc``, per the NCC_EARG001 doc), ``XLA_USE_BF16`` /
``XLA_DOWNCAST_BF16`` (cast the graph on the lazy-XLA path; unverified for trace, refused either way),
``XLA_USE_32BIT_LONG`` (narrows int64 in the graph), and a ``NEURON_CC_FLAGS`` holding any flag that is
not output-neutral. Refusing rather than dropping them: an operator who set one expects it to apply.
"""

from __future__ import annotations

from collections.abc import Mapping

from compilesvc.spec.flags import FlagError, canonical_flags

ALLOWED = frozenset({
    "PATH", "HOME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "USER", "LOGNAME", "PYTHONPATH", "LD_LIBRARY_PATH",
    "VIRTUAL_ENV", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
    # Paths, not settings: torch's download cache, and inductor's cache (the cpu backend replaces it with a
    # fresh directory per compile; other TORCHINDUCTOR_* variables change generated code and are dropped).
    "TORCH_HOME", "TORCHINDUCTOR_CACHE_DIR",
    "COMPILESVC_NEURON_SDK",
    "NEURON_CC_FLAGS",  # output-neutral flags only (checked at worker start): cache, logs, verbosity
})
ALLOWED_PREFIXES = ("LC_", "NEURON_RT_", "COMPILESVC_NEURON_DOUBLE_", "COMPILESVC_NEURON_DEVICE_GLOB")
#: Even under an allowed prefix, names like these are secrets and are dropped.
SECRET_MARKERS = ("SECRET", "TOKEN", "PASSWORD", "PASSWD", "CREDENTIAL", "_KEY", "AUTH")

#: Variables that change the compiler's output -> where the setting belongs instead.
OUTPUT_CHANGING: dict[str, str] = {
    "NEURON_LOGICAL_NC_CONFIG": "the spec's compiler.args (--lnc N)",
    "XLA_USE_BF16": "the spec's compiler.args (--auto-cast all --auto-cast-type bf16), or a model cast before "
                    "it is submitted",
    "XLA_DOWNCAST_BF16": "the spec's compiler.args (--auto-cast all --auto-cast-type bf16), or a model cast "
                         "before it is submitted",
    "XLA_USE_32BIT_LONG": "the model (cast int64 inputs before submitting) or the spec's input dtypes",
}
NEURON_CC_FLAGS = "NEURON_CC_FLAGS"
#: The SDK's platform target override, and the targets it names (the SDK's own list includes trn1n; trn3:
#: aws-neuron-sdk nki/api/nki/__init__.py "Supported values: trn1|inf2|gen2, trn2|gen3, trn3|gen4", and
#: nki/get-started/quickstart-implement-run-kernel.rst "NEURON_PLATFORM_TARGET_OVERRIDE=trn3").
PLATFORM_OVERRIDE_ENV = "NEURON_PLATFORM_TARGET_OVERRIDE"
NEURON_PLATFORM_TARGETS = frozenset({"inf2", "trn1", "trn1n", "trn2", "trn3"})


def allowed(name: str) -> bool:
    """Whether the worker's variable ``name`` may reach the compiler child."""
    upper = name.upper()
    if any(marker in upper for marker in SECRET_MARKERS):
        return False
    return name in ALLOWED or name.startswith(ALLOWED_PREFIXES)


def child_environment_for(target: str) -> dict[str, str]:
    """What a compile child for ``target`` needs in its environment from process start: the SDK reads
    ``NEURON_PLATFORM_TARGET_OVERRIDE`` once, when its libraries are imported (optimum-neuron #961/#988)."""
    return {PLATFORM_OVERRIDE_ENV: target} if target in NEURON_PLATFORM_TARGETS else {}


def child_environment(environ: Mapping[str, str], target: str | None = None) -> dict[str, str]:
    """The compiler child's environment: the allowed part of ``environ``, plus what a compile for ``target``
    needs from process start (see the module doc)."""
    env = {name: value for name, value in environ.items() if allowed(name)}
    env["PYTHONUNBUFFERED"] = "1"  # lines reach the central log as they are printed
    if target is not None:
        env.update(child_environment_for(target))
    return env


def output_changing_problems(environ: Mapping[str, str]) -> list[str]:
    """Why a worker with ``environ`` must not compile for Neuron, one message per variable (empty: none)."""
    problems = [f"{name}={environ[name]!r} changes the compiler's output but is not in the key: unset it; the "
                f"setting belongs in {where}"
                for name, where in OUTPUT_CHANGING.items() if name in environ]
    raw = environ.get(NEURON_CC_FLAGS, "")
    if raw.strip():
        try:
            affecting = canonical_flags([raw])  # drops cache/log/verbosity flags: what is left changes output
        except (FlagError, ValueError) as exc:
            problems.append(f"{NEURON_CC_FLAGS}={raw!r} cannot be parsed ({exc}): unset it")
        else:
            if affecting:
                problems.append(f"{NEURON_CC_FLAGS} holds flags that change the compiler's output "
                                f"({' '.join(affecting)}) but are not in the key: they belong in the spec's "
                                f"compiler.args; only cache, log and verbosity flags may stay there")
    return problems

