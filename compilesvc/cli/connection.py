"""The command line's link to the API: ``--api``, :func:`connect` (the URL and token of
:mod:`compilesvc.client.config` on :class:`compilesvc.client.api.Api`), and ``compilesvc upload``, which
streams a model. ``compilesvc fetch`` is :mod:`compilesvc.cli.fetch`.
"""

from __future__ import annotations

from pathlib import Path

import click

from compilesvc.cli.main import BadInput
from compilesvc.client import config as client_config
from compilesvc.client.api import Api

API_OPTION = click.option(
    "--api", metavar="URL",
    help=f"The API (default: ${client_config.API_ENV}, else api_url in the config file, else "
         f"{client_config.DEFAULT_API}). The token comes from ${client_config.TOKEN_ENV} or the config file "
         "(docs/ci.md).")


def connect(api: str | None, timeout: float = 30.0) -> Api:
    """The client of the API named by ``--api`` (or the environment, or the config file), with the token."""
    try:
        config = client_config.load(api)
    except client_config.ConfigError as exc:
        raise BadInput(str(exc)) from None
    return Api(config.api_url, timeout, token=config.token,
               token_source=config.token_source or client_config.TOKEN_ENV)


@click.command("upload")
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@API_OPTION
def upload(path: Path, api: str | None) -> None:
    """Upload the model file PATH (streamed) and print its blob:sha256: URI, for a spec's model.uri."""
    result = connect(api, timeout=600).request("POST", "/v1/models", upload=path)
    click.echo(result["uri"])
