"""``compilesvc rollforward-policies``: standing roll-forwards through the API
(:mod:`compilesvc.lifecycle.policies`): when the first worker of a new SDK release registers, each enabled
policy covering its target starts a campaign to that release by itself.

Exit status (docs/fleet.md, "Roll-forwards that start themselves"): 0 done; 2 the command line or the
request is wrong (a bad field, a name taken, no such policy); 3 the service failed or did not answer.
"""

from __future__ import annotations

import json
from typing import Any

import click

from compilesvc.cli.builds import call
from compilesvc.cli.campaigns import _labels
from compilesvc.cli.connection import API_OPTION, connect


def line(policy: dict[str, Any]) -> str:
    selection = [f"target={policy['target'] or 'neuron'}", f"from={policy['from_sdk'] or 'newest-older'}"]
    selection += [f"model={policy['model']}"] if policy["model"] else []
    selection += [f"label:{k}={v}" for k, v in sorted(policy["labels"].items())]
    selection += ["pinned"] if policy["pinned"] else []
    selection += [f"fetched-within={policy['fetched_within_days']:g}d"] if policy["fetched_within_days"] else []
    fired = ", ".join(f"{run['to_sdk']}->campaign {run['campaign_id']}" if run["campaign_id"] else
                      f"{run['to_sdk']}: {run['note']}" for run in policy["runs"])
    state = "enabled" if policy["enabled"] else "disabled"
    return f"{policy['id']}\t{policy['name']}\t{state}\t{' '.join(selection)}\t{fired or 'not fired yet'}"


@click.group("rollforward-policies")
def policies_group() -> None:
    """Standing roll-forwards: started by the first worker of a new SDK release."""


@policies_group.command("add")
@click.argument("name")
@click.option("--target", type=click.Choice(["inf2", "trn1", "trn2", "cpu"]),
              help="Only this target's new releases and artifacts (default: the Neuron targets).")
@click.option("--from-sdk", metavar="RELEASE",
              help="Move from this release (default: the newest older one with published artifacts).")
@click.option("--model", metavar="NAME", help="Only artifacts of this model name.")
@click.option("--label", "labels", multiple=True, metavar="NAME=VALUE", callback=_labels,
              help="Only artifacts with a build carrying this label (repeatable: all must match).")
@click.option("--pinned", is_flag=True, help="Only artifacts a retention pin keeps.")
@click.option("--fetched-within", "fetched_within_days", type=click.FloatRange(min=0, min_open=True), metavar="DAYS",
              help="Only artifacts fetched by key within DAYS.")
@click.option("--disabled", is_flag=True, help="Store it disabled (it starts nothing).")
@API_OPTION
def policies_add(name: str, target: str | None, from_sdk: str | None, model: str | None, labels: dict[str, str],
                 pinned: bool, fetched_within_days: float | None, disabled: bool, api: str | None) -> None:
    """Add policy NAME (admin token); prints its id."""
    body = {"name": name, "target": target, "from_sdk": from_sdk, "model": model, "labels": labels,
            "pinned": pinned, "fetched_within_days": fetched_within_days, "enabled": not disabled}
    made = call(connect(api), "POST", "/v1/rollforward-policies", {k: v for k, v in body.items() if v is not None})
    click.echo(made["id"])


@policies_group.command("list")
@click.option("--json", "as_json", is_flag=True, help="One JSON document.")
@API_OPTION
def policies_list(as_json: bool, api: str | None) -> None:
    """Every policy, with the releases it fired for and their campaigns."""
    listed = call(connect(api), "GET", "/v1/rollforward-policies")
    if as_json:
        click.echo(json.dumps(listed, indent=1))
        return
    for policy in listed["items"]:
        click.echo(line(policy))


@policies_group.command("remove")
@click.argument("policy")
@API_OPTION
def policies_remove(policy: str, api: str | None) -> None:
    """Remove POLICY (its id or name; admin token). Campaigns it started go on."""
    removed = call(connect(api), "DELETE", f"/v1/rollforward-policies/{policy}")
    click.echo(f"removed {removed['name']}", err=True)


@policies_group.command("enable")
@click.argument("policy")
@API_OPTION
def policies_enable(policy: str, api: str | None) -> None:
    """Enable POLICY (its id or name; admin token): it fires for the next new release."""
    call(connect(api), "POST", f"/v1/rollforward-policies/{policy}/enable")


@policies_group.command("disable")
@click.argument("policy")
@API_OPTION
def policies_disable(policy: str, api: str | None) -> None:
    """Disable POLICY (its id or name; admin token): it starts nothing until enabled."""
    call(connect(api), "POST", f"/v1/rollforward-policies/{policy}/disable")

