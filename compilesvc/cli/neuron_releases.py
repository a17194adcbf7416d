"""``compilesvc neuron-releases show|refresh``: the Neuron SDK release table (:mod:`compilesvc.spec.neuron_releases`)
as a maintainer reads it and refreshes it from the SDK's own manifest (``n2-manifest.json``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click

from compilesvc.cli.main import BadInput, CommandFailed
from compilesvc.spec import neuron_releases
from compilesvc.spec import neuron_releases_refresh as refresh


@click.group("neuron-releases")
def neuron_releases_group() -> None:
    """The Neuron SDK release table: the exact packages of each SDK release (keys and workers use it)."""


def _read_sdk_manifest(source: str) -> Any:
    """The SDK's n2-manifest.json document from a path or an http(s) URL."""
    if urlsplit(source).scheme in ("http", "https"):
        import urllib.request  # only for a manifest given by URL: it brings http.client and ssl

        try:
            with urllib.request.urlopen(source, timeout=60) as response:
                raw = response.read()
        except OSError as exc:
            raise CommandFailed(f"cannot download {source}: {exc}") from None
    else:
        try:
            raw = Path(source).read_bytes()
        except OSError as exc:
            raise BadInput(f"cannot read {source}: {exc.strerror or exc}") from None
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise BadInput(f"{source}: not JSON ({exc})") from None


@neuron_releases_group.command("refresh")
@click.option("--from", "source", required=True, metavar="FILE_OR_URL",
              help="The SDK's src/helperscripts/n2-manifest.json (a path, or an http(s) URL such as "
                   f"{neuron_releases.SDK_MANIFEST_URL}).")
@click.option("--to", "target", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The table to rewrite (default: the one this package ships, compilesvc/neuron_releases.json).")
@click.option("--allow-changes", is_flag=True,
              help="Accept a release whose packages differ from the table's (its keys change: its cached "
                   "artifacts are no longer found).")
def neuron_releases_refresh(source: str, target: Path | None, allow_changes: bool) -> None:
    """Merge the releases of the SDK's release manifest into the release table.

    Releases already in the table and absent from the manifest are kept. A listed release whose packages
    changed is refused unless --allow-changes: a published release does not change, and the key of every
    Neuron compile of it would.
    """
    path = target or neuron_releases.table_path()
    document = _read_sdk_manifest(source)
    try:
        current = json.loads(path.read_text(encoding="utf-8")) if path.exists() else None
    except (OSError, ValueError) as exc:
        raise CommandFailed(f"cannot read the current table {path}: {exc}") from None
    try:
        new, added, changed = refresh.refreshed_document(current, document, source)
    except ValueError as exc:
        raise BadInput(f"{source}: {exc}") from None
    if changed and not allow_changes:
        raise CommandFailed(f"releases {', '.join(changed)} list other packages than the table has; their keys "
                            f"would change (rerun with --allow-changes if the SDK really republished them)")
    try:
        refresh.write_table(new, path)
    except OSError as exc:
        raise CommandFailed(f"cannot write {path}: {exc.strerror or exc}") from None
    click.echo(f"wrote {path}: {len(new['releases'])} releases; added {', '.join(added) or 'none'}; "
               f"changed {', '.join(changed) or 'none'}")


@neuron_releases_group.command("show")
@click.argument("release", required=False)
def neuron_releases_show(release: str | None) -> None:
    """Print one release's packages (or every release's) as JSON."""
    if release is None:
        click.echo(json.dumps({label: r.as_versions() for label, r in neuron_releases.table().items()}, indent=1))
        return
    try:
        click.echo(json.dumps(neuron_releases.lookup(release).as_versions(), indent=1))
    except neuron_releases.UnknownRelease as exc:
        raise BadInput(str(exc)) from None
