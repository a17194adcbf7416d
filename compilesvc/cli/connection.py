"""The command line's link to the API: ``--api``, :func:`connect` (the URL and token of
:mod:`compilesvc.client.config` on :class:`compilesvc.client.api.Api`), and ``compilesvc upload``, which
streams a model file, or a checkpoint directory archived as :mod:`compilesvc.client.checkpoint_archive` makes
it. ``compilesvc fetch`` is :mod:`compilesvc.cli.fetch`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import click

from compilesvc.cli.main import BadInput
from compilesvc.client import config as client_config
from compilesvc.client.api import Api
from compilesvc.client.checkpoint_archive import ArchiveRefused, write_archive

API_OPTION = click.option(
    "--api", metavar="URL",
    help=f"The API (default: ${client_config.API_ENV}, else api_url in the config file, else "
         f"{client_config.DEFAULT_API}). The token comes from ${client_config.TOKEN_ENV} or the config file "
         "(docs/ci.md).")


def connect(api: str | None, timeout: float = 30.0) -> Api:
    """The client of the API named by ``--api`` (or the environment, or the config file), with the token.
    Its failures exit as :mod:`compilesvc.client.exits` says (an :class:`ApiError` carries its status; a
    bad config or API URL is exit 2 here), and its first retry of a request says so on stderr, once."""
    try:
        config = client_config.load(api)
    except client_config.ConfigError as exc:
        raise BadInput(str(exc)) from None
    return Api(config.api_url, timeout, token=config.token,
               token_source=config.token_source or client_config.TOKEN_ENV, on_retry=_RetryNotice())


class _RetryNotice:
    """One stderr line the first time the client retries: otherwise an unreachable API is
    :data:`compilesvc.client.api.RETRY_BUDGET_SECONDS` of silence before its error."""

    def __init__(self) -> None:
        self.said = False

    def __call__(self, why: str) -> None:
        if not self.said:
            self.said = True
            click.echo(f"warning: {why}", err=True)


@click.command("upload")
@click.argument("path", type=click.Path(exists=True, path_type=Path))
@API_OPTION
def upload(path: Path, api: str | None) -> None:
    """Upload the model file PATH (streamed), or the Hugging Face checkpoint directory PATH, and print its
    blob:sha256: URI, for a spec's model.uri.

    A directory (config.json and the weights, for an hf-checkpoint spec) is uploaded as a tar archive made
    the same way on every machine (sorted files, no owners or times), so the same checkpoint is always the
    same URI and uploading it again is free. The archive is written first to a temporary file in the system
    temporary directory ($TMPDIR, else /tmp: it needs as much free space as the checkpoint), which is removed
    when the command ends, however it ends. Symbolic links leaving the directory, special files and a
    directory without config.json are refused (exit status 2).
    """
    client = connect(api, timeout=600)
    if not path.is_dir():
        click.echo(client.request("POST", "/v1/models", upload=path)["uri"])
        return
    with _temporary_archive(path) as archive:
        click.echo(client.request("POST", "/v1/models", upload=archive)["uri"])


@contextlib.contextmanager
def _temporary_archive(directory: Path) -> Iterator[Path]:
    """The checkpoint ``directory`` archived into a temporary file, removed on the way out, including on
    SIGTERM (turned into an exit here: its default would leave the file behind) and Ctrl-C."""
    def terminate(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    fd, name = tempfile.mkstemp(prefix="compilesvc-upload-", suffix=".tar")
    try:
        with os.fdopen(fd, "wb") as out:
            try:
                write_archive(directory, out)
            except ArchiveRefused as exc:
                raise BadInput(str(exc)) from None
            except OSError as exc:
                raise BadInput(f"cannot archive {directory}: {exc.strerror or exc}") from None
        yield Path(name)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)
        signal.signal(signal.SIGTERM, previous)
