"""``compilesvc gc`` (run where the service's settings reach its ledger and store, like ``migrate``: a
cron job or a Kubernetes CronJob) and ``compilesvc pins`` (through the API).

gc exit status: 0 done (or planned, with --dry-run); 1 the ledger or the store failed (what was deleted
before is recorded; run it again); 2 a bad option or setting.
"""

from __future__ import annotations

import json
from typing import Any

import click

from compilesvc.cli.connection import API_OPTION, connect
from compilesvc.cli.main import BadInput, CommandFailed, _settings, ledger_services
from compilesvc.client.api import ApiError

MIB = 1024 * 1024


def _text(report: Any) -> list[str]:
    what = "would delete" if report.dry_run else "deleted"
    lines = [f"gc run {report.run_id}{' (dry run)' if report.dry_run else ''}: {what} {len(report.artifacts)} "
             f"artifact(s), {len(report.buckets)} bucket compile(s) only they held, "
             f"{len(report.sweep.documents)} manifest(s) and {len(report.sweep.blobs)} blob(s) "
             f"({report.bytes_freed / MIB:.1f} MiB)"]
    lines += [f"artifact {a.key}: {a.reason}" for a in report.artifacts]
    lines += [f"manifest {name}" for name, _ in report.sweep.documents]
    lines += [f"blob {b.sha256} ({b.size} bytes)" for b in report.sweep.blobs]
    return lines


@click.command("gc")
@click.option("--dry-run", is_flag=True, help="List what would be deleted; delete nothing.")
@click.option("--min-age-days", type=click.FloatRange(min=0), help="Override COMPILESVC_RETENTION_MIN_AGE_DAYS.")
@click.option("--unfetched-days", type=click.FloatRange(min=0),
              help="Override COMPILESVC_RETENTION_UNFETCHED_DAYS.")
@click.option("--retired", metavar="RELEASES", help="Override COMPILESVC_RETENTION_RETIRED_SDKS (2.19.0,cpu:2.12.0).")
@click.option("--grace-seconds", type=click.FloatRange(min=0), help="Override COMPILESVC_GC_GRACE_SECONDS.")
@click.option("--json", "as_json", is_flag=True, help="One JSON document.")
def gc_command(dry_run: bool, min_age_days: float | None, unfetched_days: float | None, retired: str | None,
               grace_seconds: float | None, as_json: bool) -> None:
    """Delete unpinned artifacts the retention policy releases, then the manifests and blobs nothing live
    names any more (docs/deploy.md, "Retention"). Never a pinned artifact or one a build in flight holds."""
    # The ledger and the store load when gc runs, not when the CLI lists its commands (start-up cost).
    from sqlalchemy.exc import SQLAlchemyError

    from compilesvc.lifecycle import retention
    from compilesvc.store import StoreError

    try:
        policy = retention.Policy.from_settings(_settings(), min_age_days=min_age_days,
                                                unfetched_days=unfetched_days, retired=retired,
                                                grace_seconds=grace_seconds)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    with ledger_services() as services:
        try:
            report = retention.run(services.sessions, services.store, policy, dry_run=dry_run,
                                   started_by="compilesvc gc")
        except (SQLAlchemyError, StoreError) as exc:
            raise CommandFailed(f"gc stopped: {type(exc).__name__}: {exc}") from None
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=1))
    else:
        click.echo("\n".join(_text(report)))


@click.group("pins")
def pins_group() -> None:
    """Pins: artifacts retention never deletes (by key, model name or build label)."""


@pins_group.command("list")
@click.option("--json", "as_json", is_flag=True)
@API_OPTION
def pins_list(as_json: bool, api: str | None) -> None:
    """Every pin."""
    pins = connect(api).request("GET", "/v1/pins")
    if as_json:
        click.echo(json.dumps(pins, indent=1))
        return
    for pin in pins["items"]:
        click.echo(f"{pin['id']}\t{pin['kind']}\t{pin['value']}\t{pin['note'] or ''}")


@pins_group.command("add")
@click.option("--artifact", "key", metavar="KEY", help="Pin one artifact.")
@click.option("--model", metavar="NAME", help="Pin every artifact of this model name.")
@click.option("--label", metavar="NAME=VALUE", help="Pin every artifact with a build carrying this label.")
@click.option("--note", help="Why (shown in lists).")
@API_OPTION
def pins_add(key: str | None, model: str | None, label: str | None, note: str | None, api: str | None) -> None:
    """Add a pin (admin token); prints its id."""
    given = [(kind, value) for kind, value in (("artifact", key), ("model", model), ("label", label)) if value]
    if len(given) != 1:
        raise BadInput("give exactly one of --artifact, --model or --label")
    kind, value = given[0]
    if kind == "label":
        name, sep, text = value.partition("=")
        if not sep or not name:
            raise BadInput(f"--label {value!r}: expected NAME=VALUE")
        value = f"{name}:{text}"
    try:
        pin = connect(api).request("POST", "/v1/pins", {"kind": kind, "value": value, "note": note})
    except ApiError as exc:
        if exc.status == 422:
            raise BadInput(exc.message) from None
        raise
    click.echo(pin["id"])


@pins_group.command("remove")
@click.argument("pin_id", type=click.IntRange(min=1))
@API_OPTION
def pins_remove(pin_id: int, api: str | None) -> None:
    """Remove pin PIN_ID (admin token)."""
    connect(api).request("DELETE", f"/v1/pins/{pin_id}")
