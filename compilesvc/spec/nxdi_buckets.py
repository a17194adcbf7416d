"""NxD Inference's sequence buckets as a spec gives them: our short form ``buckets: [128, 512, 2048]`` expanded to
``enable_bucketing`` + ``context_encoding_buckets`` + ``token_generation_buckets``, NxDI's own lists checked and
sorted as its config.py does, and the lists NxDI would generate for ``enable_bucketing`` alone written out, so
that the canonical NeuronConfig (:mod:`compilesvc.spec.nxdi_config`) names every bucket the compile builds.
"""

from __future__ import annotations

import math
from typing import Any

from compilesvc.spec.nxdi_fields import NeuronConfigError, NxdiRelease, nxdi_check

#: Our short form's name in neuron_config (NxDI's own ``buckets`` field is written out from it, never taken).
SHORT_FORM = "buckets"
_MIN_AUTO_BUCKET = 128  # generate_buckets(128, max_len): NXDI@ef2731e modules/autobucketing.py:L149-L279


def _generate_buckets(low: int, high: int) -> list[int]:
    """NxDI's ``generate_buckets`` (NXDI@ef2731e modules/autobucketing.py:L8-L19; v0.1.0 L7-L18)."""
    if low == high:
        return [high]
    min_bound, max_bound = int(math.log2(low)), round(math.log2(high))
    return [2 ** i for i in range(min_bound, max_bound)] + [high]



def expand_buckets(out: dict[str, Any], raw: dict[str, Any], rel: NxdiRelease) -> None:
    """Our short form -> NxDI's lists; ``enable_bucketing`` alone -> the lists NxDI would generate; lists sorted
    as NxDI sorts them (config.py:L189-L201)."""
    cte, tkg = out.get("context_encoding_buckets"), out.get("token_generation_buckets")
    max_ctx, max_len = out["max_context_length"], out["max_length"]
    if SHORT_FORM in raw:
        short = raw[SHORT_FORM]
        if not isinstance(short, list) or not short:
            raise NeuronConfigError((SHORT_FORM,), f"expected a non-empty list of sequence lengths, e.g. [128, 512, "
                                    f"{max_len}], got {short!r}")
        for index, item in enumerate(short):
            if isinstance(item, bool) or not isinstance(item, int) or item < 1:
                raise NeuronConfigError((SHORT_FORM, index), f"expected a sequence length (an integer >= 1), got "
                                        f"{item!r}")
            if item > max_len:
                raise NeuronConfigError((SHORT_FORM, index), f"bucket {item} is above seq_len/max_length {max_len}: "
                                        f"NxDI asserts 'Token generation bucket {item} should be <= {max_len}' "
                                        f"({nxdi_check(rel, 'Token generation bucket')})")
        for other in ("context_encoding_buckets", "token_generation_buckets"):
            if raw.get(other) is not None:
                raise NeuronConfigError((other,), "give either buckets (our short form) or context_encoding_buckets/"
                                        "token_generation_buckets, not both")
        if raw.get("enable_bucketing") is False:
            raise NeuronConfigError(("enable_bucketing",), "false contradicts buckets: NxDI ignores bucket lists "
                                    "without enable_bucketing (modules/autobucketing.py generate_buckets_for_cte)")
        ordered = sorted(set(short))
        cte = [b for b in ordered if b <= max_ctx]
        if not cte:
            raise NeuronConfigError((SHORT_FORM, 0), f"no bucket is at or below max_context_length {max_ctx}: the "
                                    "context-encoding model would have none")
        out.update(enable_bucketing=True, context_encoding_buckets=cte, token_generation_buckets=ordered)
        return
    if not out["enable_bucketing"]:
        for name, given in (("context_encoding_buckets", cte), ("token_generation_buckets", tkg)):
            if given is not None:
                raise NeuronConfigError((name,), "has no effect without enable_bucketing: NxDI compiles one "
                                        "bucket of max_context_length/max_length then (generate_buckets_for_cte/tkg)")
        return
    special = out.get("is_prefix_caching") or out.get("chunked_prefill_config") or out.get("is_chunked_prefill")
    for name, given, bound, label in (("context_encoding_buckets", cte, max_ctx, "Context"),
                                      ("token_generation_buckets", tkg, max_len, "Token generation")):
        if given is None:
            if not special:  # prefix caching / chunked prefill generate 2-D buckets of their own: left to NxDI
                out[name] = _generate_buckets(min(_MIN_AUTO_BUCKET, bound), bound)
            continue
        if not given:
            raise NeuronConfigError((name,), "expected at least one bucket")
        for index, item in enumerate(given):
            if item < 1:
                raise NeuronConfigError((name, index), f"expected a sequence length >= 1, got {item}")
        ordered = sorted(set(given))
        if ordered[-1] > bound:
            raise NeuronConfigError((name, given.index(ordered[-1])), f"{label} bucket {ordered[-1]} should be <= "
                                    f"{bound} ({'max_context_length' if label == 'Context' else 'max_length'}): NxDI "
                                    f"asserts it ({nxdi_check(rel, f'{label} bucket')})")
        out[name] = ordered
