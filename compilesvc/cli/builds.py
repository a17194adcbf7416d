"""The CI client: ``compilesvc submit|status|logs|cancel|retry|builds``.

``submit SPEC --wait`` is what a pipeline runs: it validates the spec locally, submits it with one
Idempotency-Key for every try (a network cut never makes a second build), then follows the build with a
line per state change and per bucket on stderr (a progress bar on a terminal), and exits with a status
that tells the pipeline what happened (:class:`compilesvc.client.follow.Exit`, documented in docs/ci.md):

    0 built or a hit   1 the model does not compile   2 bad input or refused
    3 timeout or infrastructure failure (the build may still be running)   4 cancelled

stdout carries only the result: the artifact key, or with ``--json`` one document a pipeline can parse.
The token comes from ``COMPILESVC_TOKEN`` or the config file (:mod:`compilesvc.client.config`).
"""

from __future__ import annotations

import copy
import json
import sys
import time
import urllib.parse
import uuid
from typing import Any

import click

from compilesvc.cli.connection import API_OPTION, connect
from compilesvc.cli.main import SpecUsageError
from compilesvc.client.api import Api, ApiError
from compilesvc.client.follow import Exit, Follower, bucket_detail, bucket_name, failure_report, outcome
from compilesvc.client.terminal_text import visible
from compilesvc.spec.parsing import SpecError, load_spec_file
from compilesvc.states import BucketState, BuildState

LOG_TAIL_LINES = 30
#: How long ``--wait`` waits through an API that does not answer before it exits 3 (docs/ci.md).
DEFAULT_OUTAGE_TOLERANCE = 300.0
OUTAGE_ENV = "COMPILESVC_OUTAGE_TOLERANCE"
RESULTS = {Exit.OK: "succeeded", Exit.COMPILE_ERROR: "compile_error", Exit.BAD_INPUT: "refused",
           Exit.INFRA: "infrastructure", Exit.CANCELLED: "cancelled"}


class Failed(click.ClickException):
    """A build command's failure: one ``error:`` line (the caller printed any detail), its own exit status."""

    def __init__(self, message: str, code: Exit):
        super().__init__(message)
        # click declares exit_code a ClassVar, but reads it from the instance: one class, five statuses.
        self.exit_code = int(code)  # type: ignore[misc]


def call(client: Api, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None, *,
         pinning_wait: float | None = None) -> Any:
    try:
        return client.request(method, path, body, headers, pinning_wait=pinning_wait)
    except ApiError as exc:
        raise Failed(exc.message, Exit(exc.exit_code)) from None


class Reporter:
    """Progress on stderr: lines in a log (CI), one rewritten line on a terminal."""

    def __init__(self, quiet: bool = False):
        self.tty = sys.stderr.isatty()
        self.quiet = quiet
        self._bar = False

    def line(self, text: str) -> None:
        if self.quiet:
            return
        if self._bar:
            click.echo("\r\033[K", nl=False, err=True)
            self._bar = False
        click.echo(text, err=True)

    def bar(self, text: str) -> None:
        if self.tty and not self.quiet:
            click.echo(f"\r\033[K{text}", nl=False, err=True)
            self._bar = True

    def done(self) -> None:
        if self._bar:
            click.echo("", err=True)
            self._bar = False


class PinningProgress:
    """Tells, on stderr every :data:`PINNING_EVERY` seconds at most, how far the API's hash of a large model
    (503 model-pinning, which the client waits through) has got."""

    PINNING_EVERY = 30.0

    def __init__(self, reporter: Reporter):
        self.reporter = reporter
        self._next = 0.0

    def __call__(self, problem: dict[str, Any]) -> None:
        now = time.monotonic()
        if now >= self._next:
            done, total = int(problem.get("bytes_done", 0)), int(problem.get("bytes_total", 0))
            read = f"{done / 1024**2:.0f} of {total / 1024**2:.0f} MiB read" if total else "started"
            self.reporter.line(f"waiting for the API to hash {problem.get('model', 'the model')} to pin it ({read})")
            self._next = now + self.PINNING_EVERY


def build_page(client: Api, build_id: int) -> str:
    return f"{client.base}/builds/{build_id}"


def document(client: Api, build: dict[str, Any], result: Exit | None, *, timed_out: bool = False) -> dict[str, Any]:
    """The ``--json`` answer: everything a pipeline needs, in one document."""
    key = build.get("artifact_key")
    published = build.get("state") == BuildState.SUCCEEDED
    return {
        "build_id": build.get("build_id"), "key": key, "outcome": build.get("outcome"), "state": build.get("state"),
        "result": "timeout" if timed_out else (RESULTS[result] if result is not None else "building"),
        "exit_code": int(Exit.INFRA if timed_out else (result if result is not None else Exit.OK)),
        "build_url": build_page(client, int(build.get("build_id") or 0)),
        "status_url": f"{client.base}/v1/builds/{build.get('build_id')}",
        "artifact_url": f"{client.base}/v1/artifacts/{key}" if published else None,
        "buckets": [{"position": b.get("position"), "inputs": b.get("inputs"), "state": b.get("state"),
                     "attempts": b.get("attempts"), "error_class": b.get("error_class"),
                     "error_code": b.get("error_code"), "error_message": b.get("error_message"),
                     "origin": b.get("origin")}
                    for b in build.get("buckets", [])],
    }


def log_tails(client: Api, build: dict[str, Any], keys: set[str]) -> dict[str, list[str]]:
    """The last compiler lines of the buckets ``keys`` (bounded: the whole log is a download away)."""
    tails: dict[str, list[str]] = {key: [] for key in keys}
    after = 0
    for _ in range(20):
        try:
            page = client.request("GET", f"/v1/builds/{build['build_id']}/logs?after={after}&limit=1000")
        except ApiError:
            break
        for entry in page.get("lines", []):
            if entry.get("bucket_key") in tails and entry.get("stream") == "compiler":
                tails[entry["bucket_key"]] = [*tails[entry["bucket_key"]][-(LOG_TAIL_LINES - 1):],
                                              visible(entry["line"])]
        after = page.get("next_after", after)
        if page.get("finished") or not page.get("lines"):
            break
    return tails


def follow(client: Api, build: dict[str, Any], *, timeout: float, poll: float, logs: bool,
           reporter: Reporter, outage_tolerance: float = DEFAULT_OUTAGE_TOLERANCE) -> tuple[dict[str, Any], bool]:
    """Poll the build until it ends or ``timeout`` passes; (the last document, whether it timed out). An
    outage (no answer, 5xx) is waited through, said once, for ``outage_tolerance`` seconds; then exit 3."""
    follower = Follower()
    positions: dict[str, int] = {}
    deadline = time.monotonic() + timeout
    outage_since: float | None = None
    # Each poll is tried once: this loop is the retry, bounded by the tolerance rather than by the client's
    # own retry budget on every poll.
    poller = copy.copy(client)
    poller.retries = 0
    after = 0
    while True:
        for line in follower.changes(build):
            reporter.line(line)
        positions = {str(b.get("key")): int(b.get("position", 0)) for b in build.get("buckets", [])}
        if build.get("state") != BuildState.BUILDING:
            break
        reporter.bar(follower.progress(build))
        if time.monotonic() >= deadline:
            reporter.done()
            return build, True
        time.sleep(min(poll, max(0.0, deadline - time.monotonic())))
        try:
            if logs:
                page = poller.request("GET", f"/v1/builds/{build['build_id']}/logs?after={after}&limit=1000")
                for entry in page.get("lines", []):
                    position = positions.get(entry.get("bucket_key", ""), "?")
                    reporter.line(f"[bucket {position}] {visible(entry['line'])}")
                after = page.get("next_after", after)
            build = poller.request("GET", f"/v1/builds/{build['build_id']}")
            if outage_since is not None:
                reporter.line(f"the API answers again after {time.monotonic() - outage_since:.0f} s")
                outage_since = None
        except ApiError as exc:
            if exc.exit_code != Exit.INFRA:
                raise Failed(exc.message, Exit(exc.exit_code)) from None
            now = time.monotonic()
            if outage_since is None:  # a passing outage: the build goes on; said once, not every poll
                outage_since = now
                reporter.line(f"warning: {exc.message}; still waiting, for up to {outage_tolerance:g} s "
                              "(--outage-tolerance)")
            elif now - outage_since >= outage_tolerance:
                reporter.done()
                raise Failed(f"the API has not answered for {now - outage_since:.0f} s (--outage-tolerance "
                             f"{outage_tolerance:g}): {exc.message}; build {build.get('build_id')} may still be "
                             f"running (`compilesvc status {build.get('build_id')} --wait`)", Exit.INFRA) from None
    reporter.done()
    return build, False


def finish(client: Api, build: dict[str, Any], *, as_json: bool, timed_out: bool, reporter: Reporter) -> None:
    """Report a followed build and exit with what it means."""
    build_id = build.get("build_id")
    if timed_out:
        reporter.line(f"build {build_id} is still building; it keeps running: {build_page(client, int(build_id or 0))} "
                      f"(stop it with `compilesvc cancel {build_id}`, follow it with `compilesvc status {build_id} "
                      "--wait`)")
        if as_json:
            click.echo(json.dumps(document(client, build, None, timed_out=True)))
        raise Failed(f"timed out waiting for build {build_id}", Exit.INFRA)
    result = outcome(build)
    if result == Exit.OK:
        click.echo(json.dumps(document(client, build, result)) if as_json else build["artifact_key"])
        return
    failed = {str(b.get("key")) for b in build.get("buckets", []) if b.get("state") == BucketState.FAILED}
    for line in failure_report(build, log_tails(client, build, failed)):
        reporter.line(line)
    if as_json:
        click.echo(json.dumps(document(client, build, result)))
    raise Failed(f"build {build_id} {build.get('state')} ({RESULTS[result]}): {build_page(client, int(build_id or 0))}",
                 result)


OUTAGE_OPTION = click.option(
    "--outage-tolerance", type=click.FloatRange(min=0), default=DEFAULT_OUTAGE_TOLERANCE, show_default=True,
    envvar=OUTAGE_ENV, show_envvar=True, metavar="SECONDS",
    help="While waiting, how long the API may not answer (unreachable, 5xx) before the command gives up with "
         "exit 3; the build keeps running.")


@click.command("submit")
@click.argument("spec_path", metavar="SPEC", type=click.Path(dir_okay=False, path_type=str))
@API_OPTION
@click.option("--wait/--no-wait", default=True, show_default=True, help="Follow the build until it ends.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout (build, key, buckets).")
@click.option("--timeout", type=click.FloatRange(min=0), default=6 * 3600, show_default=True,
              help="Seconds to wait at most; then exit 3 and leave the build running.")
@click.option("--poll", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              help="Seconds between status checks.")
@click.option("--logs", is_flag=True, help="Print the compiler log to stderr while waiting.")
@OUTAGE_OPTION
@click.option("--idempotency-key", help="Same key, same build (default: one random key per invocation).")
@click.option("--queue-anyway", is_flag=True, help="Queue even when no live worker serves the spec yet.")
@click.option("--quiet", "-q", is_flag=True, help="No progress lines; errors only.")
def submit(spec_path: str, api: str | None, wait: bool, as_json: bool, timeout: float, poll: float, logs: bool,
           outage_tolerance: float, idempotency_key: str | None, queue_anyway: bool, quiet: bool) -> None:
    """Submit SPEC (.json, .yaml) and, by default, wait for the build.

    stdout: the artifact key once published (with --no-wait: the build id; with --json: one document).
    Exit status: 0 built or a hit (with --no-wait: accepted); 1 the model does not compile; 2 bad input or
    refused; 3 timeout or infrastructure failure; 4 cancelled.
    """
    reporter = Reporter(quiet)
    try:
        # Element bounds and extra compiler flags are the service's settings, which this host may not share:
        # the API judges them.
        spec = load_spec_file(spec_path, limits=None, extra_flags=None)
    except SpecError as exc:
        raise Failed(SpecUsageError(spec_path, exc).format_message(), Exit.BAD_INPUT) from None
    client = connect(api)
    deadline = time.monotonic() + timeout
    client.on_pinning = PinningProgress(reporter)
    headers = {"Idempotency-Key": idempotency_key or f"cli-{uuid.uuid4()}"}
    path = "/v1/builds" + ("?queue_anyway=true" if queue_anyway else "")
    # A large S3 model is hashed by the API in the background first (503 model-pinning): part of the wait.
    accepted = call(client, "POST", path, spec.model_dump(mode="json", exclude_none=True), headers,
                    pinning_wait=timeout)
    build_id = accepted["build_id"]
    replayed = " (the first answer to this Idempotency-Key)" if accepted.get("replayed") else ""
    told = accepted["outcome"]
    if told == "join" and accepted.get("state") == BuildState.FAILED:
        told = f"failed before: its failure is remembered until `compilesvc retry {build_id}`"
    reporter.line(f"build {build_id} {told}{replayed}: {build_page(client, build_id)}")
    try:
        # The build as GET describes it: a hit's buckets and where each bucket came from (the POST answer,
        # the submit's hot path, has neither).
        accepted = {**accepted, **client.request("GET", f"/v1/builds/{build_id}")}
    except ApiError as exc:
        reporter.line(f"warning: {exc.message}; following from the submit's answer")
    if wait:
        build, timed_out = follow(client, accepted, timeout=max(0.0, deadline - time.monotonic()), poll=poll,
                                  logs=logs, reporter=reporter, outage_tolerance=outage_tolerance)
        finish(client, build, as_json=as_json, timed_out=timed_out, reporter=reporter)
        return
    # --no-wait: stdout is the build id, whatever the build's state; the key is a key only once published.
    if accepted["state"] == BuildState.BUILDING:
        reporter.line(f"build {build_id} is building; its artifact key will be {accepted['artifact_key']} once "
                      f"published (`compilesvc status {build_id} --wait`)")
    else:
        reporter.line(f"build {build_id} {accepted['state']}; artifact key {accepted['artifact_key']}")
    state = accepted["state"]
    click.echo(json.dumps(document(client, accepted, None if state == BuildState.BUILDING else outcome(accepted)))
               if as_json else str(build_id))


@click.command("status")
@click.argument("build_id", type=click.IntRange(min=1), metavar="ID")
@API_OPTION
@click.option("--wait", is_flag=True, help="Follow the build until it ends (exit status as for submit).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
@click.option("--timeout", type=click.FloatRange(min=0), default=6 * 3600, show_default=True)
@click.option("--poll", type=click.FloatRange(min=0.1), default=2.0, show_default=True)
@OUTAGE_OPTION
def status(build_id: int, api: str | None, wait: bool, as_json: bool, timeout: float, poll: float,
           outage_tolerance: float) -> None:
    """Show build ID: its state and every bucket's. Exit status as for submit once it ended; 0 while building."""
    client = connect(api)
    reporter = Reporter()
    build = call(client, "GET", f"/v1/builds/{build_id}")
    if wait:
        build, timed_out = follow(client, build, timeout=timeout, poll=poll, logs=False, reporter=reporter,
                                  outage_tolerance=outage_tolerance)
        finish(client, build, as_json=as_json, timed_out=timed_out, reporter=reporter)
        return
    ended = build["state"] != BuildState.BUILDING
    if as_json:
        if ended:
            finish(client, build, as_json=True, timed_out=False, reporter=Reporter(quiet=True))
        else:
            click.echo(json.dumps(document(client, build, None)))
        return
    click.echo(f"build {build_id} {build['state']} ({build['outcome']}): {build_page(client, build_id)}")
    click.echo(f"artifact {build['artifact_key']} ({build['artifact_state']})")
    for bucket in build.get("buckets", []):
        attempts = int(bucket.get("attempts") or 0)
        tries = f", {attempts} attempts" if attempts > 1 else ""
        click.echo(f"  {bucket_name(bucket)}: {bucket['state']}{bucket_detail(bucket)}{tries}")
    if not ended:
        return
    result = outcome(build)
    if result == Exit.CANCELLED:
        raise Failed(f"build {build_id} was cancelled: `compilesvc retry {build_id}` builds its cancelled "
                     "compiles again", result)
    if result != Exit.OK:
        failed = {str(b.get("key")) for b in build.get("buckets", []) if b.get("state") == BucketState.FAILED}
        for line in failure_report(build, log_tails(client, build, failed))[1:]:
            reporter.line(visible(line))  # error messages quote the compiler too
        raise Failed(f"build {build_id} {build['state']} ({RESULTS[result]})", result)


@click.command("logs")
@click.argument("build_id", type=click.IntRange(min=1), metavar="ID")
@API_OPTION
@click.option("--follow", "-f", "follow_", is_flag=True, help="Keep printing lines until the build ends.")
@click.option("--bucket", type=click.IntRange(min=0), help="Only this bucket (its position).")
@click.option("--raw", is_flag=True, help="Print the lines as logged, terminal control sequences and all (by "
                                          "default each control character but tab is shown as \\xNN).")
def logs(build_id: int, api: str | None, follow_: bool, bucket: int | None, raw: bool) -> None:
    """Print build ID's compile log, each line labelled with its bucket's position. The compile wrote the lines:
    control characters (escape sequences, carriage returns) are shown as ``\\xNN`` text unless ``--raw``."""
    client = connect(api)
    build = call(client, "GET", f"/v1/builds/{build_id}")
    positions = {str(b["key"]): int(b["position"]) for b in build.get("buckets", [])}
    after = 0
    while True:
        page = call(client, "GET", f"/v1/builds/{build_id}/logs?after={after}&limit=1000")
        for entry in page.get("lines", []):
            position = positions.get(entry.get("bucket_key", ""))
            if bucket is None or position == bucket:
                # color=True: click would strip CSI sequences (not OSC) from a non-terminal's output; raw is raw.
                click.echo(f"[bucket {position}] {entry['line'] if raw else visible(entry['line'])}", color=raw or None)
        after = page.get("next_after", after)
        if page.get("finished") or (not follow_ and len(page.get("lines", [])) < 1000):
            return
        if not page.get("lines"):
            time.sleep(1.0)


def _control(action: str, build_id: int, api: str | None) -> None:
    client = connect(api)
    answer = call(client, "POST", f"/v1/builds/{build_id}/{action}")
    click.echo(f"build {build_id}: {answer['state']} (artifact {answer['artifact_state']})")


@click.command("cancel")
@click.argument("build_id", type=click.IntRange(min=1), metavar="ID")
@API_OPTION
def cancel(build_id: int, api: str | None) -> None:
    """Cancel build ID (your team's, or any with an admin token)."""
    _control("cancel", build_id, api)


@click.command("retry")
@click.argument("build_id", type=click.IntRange(min=1), metavar="ID")
@API_OPTION
def retry(build_id: int, api: str | None) -> None:
    """Retry build ID's failed or cancelled compiles."""
    _control("retry", build_id, api)


@click.command("builds")
@API_OPTION
@click.option("--target")
@click.option("--sdk")
@click.option("--state")
@click.option("--model", help="Model name or sha256.")
@click.option("--submitted-by")
@click.option("--label", metavar="NAME:VALUE")
@click.option("--limit", type=click.IntRange(1, 200), default=20, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def builds(api: str | None, target: str | None, sdk: str | None, state: str | None, model: str | None,
           submitted_by: str | None, label: str | None, limit: int, as_json: bool) -> None:
    """Build history, newest first."""
    filters = {"target": target, "sdk": sdk, "state": state, "model": model, "submitted_by": submitted_by,
               "label": label, "limit": limit}
    query = urllib.parse.urlencode({k: v for k, v in filters.items() if v is not None})
    page = call(connect(api), "GET", f"/v1/builds?{query}")
    if as_json:
        click.echo(json.dumps(page["items"]))
        return
    click.echo(f"{'ID':>7}  {'STATE':9} {'OUTCOME':7} {'TARGET':6} {'SDK':9} {'MODEL':20} {'BY':16} CREATED")
    for item in page["items"]:
        click.echo(f"{item['build_id']:>7}  {item['state']:9} {item['outcome']:7} {item['target']:6} "
                   f"{item['sdk'][:9]:9} {(item.get('model_name') or item['model_sha256'][:12])[:20]:20} "
                   f"{(item.get('submitted_by') or '-')[:16]:16} {item['created_at'][:19]}")
