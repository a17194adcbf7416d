"""Following a build from the client side: what changed since the last look, how to say it, and what the
build's end means for a CI job (its exit status).

:class:`Follower` turns successive ``GET /v1/builds/{id}`` documents into lines: one per build state
change and one per bucket state change, naming buckets by position and shape (``bucket 1 (input_ids:
int64[2, 128])``; an NxD Inference compile's one bucket, which has no inputs: ``bucket 0 (the whole NxDI
model)``), never by a key prefix. :func:`outcome` maps a finished build to an :class:`compilesvc.client.exits.Exit`;
:func:`failure_report` is what a failed build says, with each failed bucket's whole compiler message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from compilesvc.client.exits import Exit
from compilesvc.spec.keys import shape_text
from compilesvc.states import BucketState, BuildState

__all__ = ["EXIT_FOR_ERROR_CLASS", "Exit", "Follower", "bucket_detail", "bucket_name", "failure_report", "outcome"]


#: How a failed bucket's error class decides the exit status.
EXIT_FOR_ERROR_CLASS = {
    "compile": Exit.COMPILE_ERROR,
    "unknown": Exit.COMPILE_ERROR,  # retried already, failing the same way: nothing else to blame but the model
    "bad_request": Exit.BAD_INPUT,  # the compiler refused a flag of the spec
    "infra": Exit.INFRA,
    "timeout": Exit.INFRA,
    "model": Exit.INFRA,            # the pinned model bytes vanished or changed: resubmitting pins them again
    "cancelled": Exit.CANCELLED,
}


def bucket_name(bucket: dict[str, Any]) -> str:
    inputs = bucket.get("inputs") or []
    # An NxD Inference compile is one bucket with no inputs (its sequence buckets are inside model.pt): "()" said
    # nothing, so it is named for what it is.
    return f"bucket {bucket.get('position')} ({shape_text(inputs) if inputs else 'the whole NxDI model'})"


def bucket_detail(bucket: dict[str, Any]) -> str:
    """What a bucket's state line adds to its state: where it runs, how long it took, why it failed, and where a
    bucket this build did not compile came from (``origin``, GET /v1/builds/{id}): a reused bucket did not
    just take its compile time."""
    state = bucket.get("state")
    origin = bucket.get("origin") or {}
    how, source = origin.get("how"), origin.get("from_build")
    elsewhere = f" from build {source}" if source is not None else ""
    if state == BucketState.RUNNING:
        attempts = int(bucket.get("attempts") or 0)
        stopping = " (cancelled, stopping)" if bucket.get("cancel_requested") else ""
        return f" on {bucket.get('worker_id')}" + (f", attempt {attempts}" if attempts > 1 else "") + stopping
    if state == BucketState.SUCCEEDED:
        if how == "reused":
            return f" (reused{elsewhere})"
        if how == "imported":
            return " (imported from the store)"
        took = f" in {bucket['compile_seconds']:.1f} s" if bucket.get("compile_seconds") is not None else ""
        return took + (f" (build {source}'s compile)" if how == "joined" and source is not None else "")
    if state == BucketState.FAILED:
        code = f" {bucket['error_code']}" if bucket.get("error_code") else ""
        remembered = f" (a failure remembered{elsewhere})" if how == "failed" else ""
        return f": {bucket.get('error_class')}{code}{remembered}"
    return ""


def outcome(build: dict[str, Any]) -> Exit:
    """What a finished build means for the job that waited for it."""
    state = build.get("state")
    if state == BuildState.SUCCEEDED:
        return Exit.OK
    if state == BuildState.CANCELLED:
        return Exit.CANCELLED
    classes = [b.get("error_class") for b in build.get("buckets", []) if b.get("state") == BucketState.FAILED]
    exits = [EXIT_FOR_ERROR_CLASS.get(c or "", Exit.INFRA) for c in classes]
    # A compile error anywhere decides: retrying the infrastructure cannot make the model compile.
    for verdict in (Exit.COMPILE_ERROR, Exit.BAD_INPUT, Exit.INFRA, Exit.CANCELLED):
        if verdict in exits:
            return verdict
    return Exit.INFRA


def failure_report(build: dict[str, Any], log_tail: dict[str, list[str]] | None = None) -> list[str]:
    """Lines saying why ``build`` failed: each failed bucket by position and shape, its class and code, its
    whole error message, and the last compiler lines of its log (``log_tail`` by bucket key)."""
    lines = [f"build {build.get('build_id')} {build.get('state')}"]
    for bucket in build.get("buckets", []):
        if bucket.get("state") not in (BucketState.FAILED, BucketState.CANCELLED):
            continue
        code = f" {bucket['error_code']}" if bucket.get("error_code") else ""
        lines.append(f"{bucket_name(bucket)} {bucket.get('state')}: {bucket.get('error_class')}{code}")
        message = (bucket.get("error_message") or "").rstrip()
        lines.extend(f"    {line}" for line in message.splitlines())
        tail = (log_tail or {}).get(str(bucket.get("key")), [])
        if tail:
            lines.append("    compiler log (last lines):")
            lines.extend(f"    | {line}" for line in tail)
    return lines


@dataclass
class Follower:
    """Remembers what a build looked like, and says what changed."""

    build_state: str | None = None
    bucket_states: dict[int, tuple[str, int]] = field(default_factory=dict)

    def changes(self, build: dict[str, Any]) -> list[str]:
        lines = []
        for bucket in build.get("buckets", []):
            position = int(bucket.get("position", 0))
            now = (str(bucket.get("state")), int(bucket.get("attempts") or 0))
            before = self.bucket_states.get(position)
            if before == now:
                continue
            self.bucket_states[position] = now
            was = f"{before[0]} -> " if before else ""
            lines.append(f"{bucket_name(bucket)}: {was}{now[0]}{bucket_detail(bucket)}")
        state = build.get("state")
        if state != self.build_state:
            if self.build_state is not None:
                lines.append(f"build {build.get('build_id')}: {self.build_state} -> {state}")
            self.build_state = state
        return lines

    def progress(self, build: dict[str, Any]) -> str:
        """One line for a terminal's progress bar: ``[####----] 2/4 succeeded, 1 running, 1 queued``."""
        buckets = build.get("buckets", [])
        total = len(buckets) or 1
        counts: dict[str, int] = {}
        for bucket in buckets:
            counts[str(bucket.get("state"))] = counts.get(str(bucket.get("state")), 0) + 1
        done = counts.get(BucketState.SUCCEEDED, 0)
        width = 20
        bar = "#" * (done * width // total) + "-" * (width - done * width // total)
        rest = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()) if state != BucketState.SUCCEEDED)
        return f"[{bar}] {done}/{len(buckets)} succeeded" + (f", {rest}" if rest else "")
