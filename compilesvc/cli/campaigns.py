"""``compilesvc rollforward`` and ``compilesvc campaigns``: an operator moving a fleet's artifacts to a new
Neuron SDK release through the API (:mod:`compilesvc.lifecycle.campaigns`), and following the campaign.

Exit status (docs/fleet.md, "Rolling forward"): 0 every artifact built or already there for the new
release (a dry run: listed); 1 some failed to compile or were refused by the new release; 2 the command
line or the request is wrong; 3 timed out waiting (the campaign goes on) or the service failed.
"""

from __future__ import annotations

import json
import time
from typing import Any, get_args

import click

from compilesvc.cli.builds import Failed, Reporter, call
from compilesvc.cli.connection import API_OPTION, connect
from compilesvc.client.follow import Exit
from compilesvc.spec.compile_spec import Target

POLL_SECONDS = 2.0


def _labels(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for value in values:
        name, sep, text = value.partition("=")
        if not sep or not name:
            raise click.BadParameter(f"{value!r}: expected NAME=VALUE")
        out[name] = text
    return out


def summary(campaign: dict[str, Any]) -> str:
    p = campaign["progress"]
    ended = p["built"] + p["hit"] + p["failed"] + p["cancelled"] + p["refused"]
    return (f"campaign {campaign['id']} ({campaign['from_sdk']} -> {campaign['to_sdk']}): {ended}/{p['total']} "
            f"ended: {p['built']} built, {p['hit']} hit, {p['failed']} failed, {p['refused']} refused, "
            f"{p['cancelled']} cancelled, {p['building']} building")


def report_failures(campaign: dict[str, Any], reporter: Reporter) -> None:
    for failure in campaign["failures"]:
        where = f"bucket {failure['position']}" if failure.get("position") is not None else "a bucket"
        code = f" [{failure['error_code']}]" if failure.get("error_code") else ""
        reporter.line(f"failed: {failure['source_key'][:12]} -> build {failure['build_id']}, {where}{code}: "
                      f"{failure.get('error_message') or failure.get('error_class') or 'no message'}")
    for refusal in campaign["refusals"]:
        reporter.line(f"refused: {refusal['source_key'][:12]}: {refusal['refusal']}")


def verdict(campaign: dict[str, Any]) -> Exit:
    p = campaign["progress"]
    return Exit.COMPILE_ERROR if p["failed"] or p["refused"] or p["cancelled"] else Exit.OK


def follow(client: Any, campaign: dict[str, Any], timeout: float | None, reporter: Reporter) -> dict[str, Any]:
    """Poll the campaign until it finishes (a line whenever its counts change); Failed(3) on timeout."""
    deadline = None if timeout is None else time.monotonic() + timeout
    last = ""
    while True:
        line = summary(campaign)
        if line != last:
            reporter.line(line)
            last = line
        if campaign["state"] == "finished":
            return campaign
        if deadline is not None and time.monotonic() >= deadline:
            raise Failed(f"campaign {campaign['id']} is still running after {timeout:g} s; it goes on: follow it "
                         f"with `compilesvc campaigns {campaign['id']} --wait`", Exit.INFRA)
        time.sleep(POLL_SECONDS)
        campaign = call(client, "GET", f"/v1/campaigns/{campaign['id']}")


def finish(campaign: dict[str, Any], as_json: bool, reporter: Reporter) -> None:
    if as_json:
        click.echo(json.dumps(campaign, indent=1))
    report_failures(campaign, reporter)
    code = verdict(campaign) if campaign["state"] == "finished" else Exit.OK
    if code != Exit.OK:
        raise Failed(f"campaign {campaign['id']}: {campaign['progress']['failed']} failed, "
                     f"{campaign['progress']['refused']} refused, {campaign['progress']['cancelled']} cancelled",
                     code)


@click.command("rollforward")
@click.option("--from-sdk", required=True, metavar="RELEASE", help="The release the artifacts were built for.")
@click.option("--to-sdk", required=True, metavar="RELEASE", help="The release to build them for.")
@click.option("--model", metavar="NAME", help="Only artifacts of this model name.")
@click.option("--target", type=click.Choice(get_args(Target)), help="Only this target.")
@click.option("--label", "labels", multiple=True, metavar="NAME=VALUE", callback=_labels,
              help="Only artifacts with a build carrying this label (repeatable: all must match).")
@click.option("--pinned", is_flag=True, help="Only artifacts a retention pin keeps.")
@click.option("--fetched-within", "fetched_within_days", type=click.FloatRange(min=0, min_open=True), metavar="DAYS",
              help="Only artifacts fetched by key within DAYS (what fleets load now).")
@click.option("--dry-run", is_flag=True, help="List what would be submitted, and the new keys; submit nothing.")
@click.option("--queue-anyway", is_flag=True,
              help="Queue the compiles even while no worker serves the new release yet.")
@click.option("--wait/--no-wait", default=True, show_default=True, help="Follow the campaign until it finishes.")
@click.option("--timeout", type=click.FloatRange(min=0), help="Stop waiting after this many seconds (exit 3).")
@click.option("--json", "as_json", is_flag=True, help="Print the campaign (or the plan) as one JSON document.")
@click.option("-q", "--quiet", is_flag=True, help="No progress lines.")
@API_OPTION
def rollforward(from_sdk: str, to_sdk: str, model: str | None, target: str | None, labels: dict[str, str],
                pinned: bool, fetched_within_days: float | None, dry_run: bool, queue_anyway: bool, wait: bool,
                timeout: float | None, as_json: bool, quiet: bool, api: str | None) -> None:
    """Build every published artifact of --from-sdk for --to-sdk, as one campaign (admin token)."""
    client = connect(api)
    reporter = Reporter(quiet or as_json)
    body = {"from_sdk": from_sdk, "to_sdk": to_sdk, "model": model, "target": target, "labels": labels,
            "pinned": pinned, "fetched_within_days": fetched_within_days, "dry_run": dry_run,
            "queue_anyway": queue_anyway}
    answer = call(client, "POST", "/v1/campaigns/rollforward", {k: v for k, v in body.items() if v is not None})
    if dry_run:
        if as_json:
            click.echo(json.dumps(answer, indent=1))
            return
        for item in answer["items"]:
            after = f"-> {item['key'][:12]} ({item['state']})" if item["key"] else f"refused: {item['refusal']}"
            click.echo(f"{item['source_key'][:12]} {item['model_name'] or '-'} {item['target']} {after}")
        click.echo(f"{len(answer['items'])} artifact(s) would move from {from_sdk} to {to_sdk}")
        return
    reporter.line(f"campaign {answer['id']}: {answer['progress']['total']} artifact(s) from {from_sdk} to "
                  f"{to_sdk}: {answer['url']}")
    if wait:
        answer = follow(client, answer, timeout, reporter)
    elif not as_json:
        click.echo(answer["id"])
    finish(answer, as_json, reporter)


@click.command("campaigns")
@click.argument("campaign_id", required=False, type=click.IntRange(min=1))
@click.option("--wait", is_flag=True, help="Follow the campaign until it finishes.")
@click.option("--timeout", type=click.FloatRange(min=0), help="Stop waiting after this many seconds (exit 3).")
@click.option("--json", "as_json", is_flag=True, help="One JSON document.")
@API_OPTION
def campaigns_command(campaign_id: int | None, wait: bool, timeout: float | None, as_json: bool,
                      api: str | None) -> None:
    """List campaigns, or show CAMPAIGN_ID's progress (with --wait, until it finishes)."""
    client = connect(api)
    if campaign_id is None:
        listed = call(client, "GET", "/v1/campaigns")
        if as_json:
            click.echo(json.dumps(listed, indent=1))
        for campaign in [] if as_json else listed["items"]:
            click.echo(f"{summary(campaign)} [{campaign['state']}]")
        return
    reporter = Reporter(as_json)
    campaign = call(client, "GET", f"/v1/campaigns/{campaign_id}")
    if wait:
        campaign = follow(client, campaign, timeout, reporter)
    else:
        reporter.line(f"{summary(campaign)} [{campaign['state']}]")
    finish(campaign, as_json, reporter)
