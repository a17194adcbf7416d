"""The ``compilesvc`` command line: artifact keys, migrations, and subcommands other packages register.

Core commands live here (``key``, ``migrate``, ``neuron-releases``, ``version``). Commands from outside the
core (``serve`` from ``web/``, ``worker`` from ``workers/``) are registered under the entry-point group
``compilesvc.commands`` and loaded only when named or listed, so the core never imports them and a broken
plugin costs one warning line instead of the whole CLI.

Every failure is reported as one ``error: …`` line on stderr, never a traceback. Exit status 2 means the
command line or the spec is wrong (usage, unreadable or invalid spec file, spec validation); 1 means the
work itself failed (model file unreadable, model lookup, database migration). A command that talks to the API
exits as :mod:`compilesvc.client.exits` says (docs/ci.md): an :class:`ApiError` that escapes carries its status.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
from collections.abc import Iterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

import compilesvc
from compilesvc.client.api import ApiError
from compilesvc.hostinfo import host_isa
from compilesvc.spec.compile_spec import ISA_RE, CompileSpec
from compilesvc.spec.keys import KEY_SCHEMA, compute_keys, explain
from compilesvc.spec.parsing import SpecError, load_spec_file

if TYPE_CHECKING:
    from compilesvc.config.settings import Settings
    from compilesvc.services import Services
    from compilesvc.spec.checkpoint import CheckpointMaterial

ENTRY_POINT_GROUP = "compilesvc.commands"
#: How many spec errors one ``error:`` line lists before summarising the rest.
MAX_ERRORS_SHOWN = 5


def _one_line(text: str) -> str:
    """Collapse whitespace so multi-line library messages still make one ``error:`` line."""
    return " ".join(text.split())


def _warn(message: str) -> None:
    click.echo(f"warning: {_one_line(message)}", err=True)


class BadInput(click.UsageError):
    """The input named on the command line is wrong (exit status 2); reported without a --help hint."""


class SpecUsageError(BadInput):
    """The spec file is missing, unreadable, not JSON/YAML, or does not validate (exit status 2)."""

    def __init__(self, path: str, exc: SpecError):
        shown = [f"{e['field']}: {e['message']}" if e["field"] else e["message"] for e in exc.errors]
        more = len(shown) - MAX_ERRORS_SHOWN
        text = "; ".join(shown[:MAX_ERRORS_SHOWN]) + (f" (and {more} more)" if more > 0 else "")
        # Messages about reading the file already name it; validation messages get it prefixed.
        prefix = "" if path in text else f"{path}: "
        super().__init__(prefix + text)


class CommandFailed(click.ClickException):
    """The command's work failed (exit status 1)."""


#: Top-level modules of the ``server`` extra (pyproject.toml; tests/workers/test_client_install.py keeps the two in
#: step): a command that imports one runs part of the service, not the client.
SERVER_PACKAGES = frozenset({"sqlalchemy", "alembic", "psycopg", "boto3", "botocore", "s3transfer", "celery",
                             "kombu", "redis", "flask", "werkzeug", "prometheus_client", "gunicorn", "http_sfv",
                             "limits", "lightkube"})


def _needs_server(name: str) -> click.Command:
    def refuse() -> None:
        raise BadInput(f"`compilesvc {name}` runs part of the service, which this client install lacks: "
                       "pip install 'compilesvc[server]'")

    return click.Command(name, callback=refuse, help="(needs the server install: compilesvc[server])",
                         context_settings={"ignore_unknown_options": True, "allow_extra_args": True})


class _Main(click.Group):
    """The root group: built-in commands, lazily loaded plugin commands, one-line errors."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._plugins: dict[str, metadata.EntryPoint] | None = None
        self._loaded: dict[str, click.Command | None] = {}

    def _plugin_entry_points(self) -> dict[str, metadata.EntryPoint]:
        if self._plugins is None:
            self._plugins = {}
            for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
                if ep.name in self.commands:
                    _warn(f"ignoring plugin command {ep.name!r} ({ep.value}): a built-in has that name")
                # The same distribution can be visible twice (an editable install plus a stale egg-info):
                # the first one found wins, as for any other import.
                self._plugins.setdefault(ep.name, ep)
        return self._plugins

    def _load_plugin(self, name: str) -> click.Command | None:
        if name not in self._loaded:
            ep = self._plugin_entry_points().get(name)
            command: click.Command | None = None
            if ep is not None:
                try:
                    loaded = ep.load()
                except ModuleNotFoundError as exc:
                    if (exc.name or "").partition(".")[0] not in SERVER_PACKAGES:
                        _warn(f"skipping command {name!r} ({ep.value}): {type(exc).__name__}: {exc}")
                    else:  # listed, with what to install, rather than missing as if mistyped
                        command = _needs_server(name)
                except Exception as exc:  # any import-time failure of someone else's module
                    _warn(f"skipping command {name!r} ({ep.value}): {type(exc).__name__}: {exc}")
                else:
                    if isinstance(loaded, click.Command):
                        command = loaded
                    else:
                        _warn(f"skipping command {name!r} ({ep.value}): not a click command")
            self._loaded[name] = command
        return self._loaded[name]

    def list_commands(self, ctx: click.Context) -> list[str]:
        builtin = sorted(self.commands)
        plugins = sorted(n for n in self._plugin_entry_points() if n not in self.commands)
        return builtin + plugins

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = self.commands.get(cmd_name)
        if command is not None:
            return command
        return self._load_plugin(cmd_name)

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        # click's standalone mode prints usage plus "Error: …" over several lines; errors here are one
        # line a script or a log search can rely on.
        try:
            result = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except BadInput as exc:
            _fail(exc.format_message(), exc.exit_code)
        except click.UsageError as exc:
            if _is_no_args_help(exc):  # bare `compilesvc`: the help text is the answer, not an error line
                exc.show()
                sys.exit(exc.exit_code)
            hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
            _fail(exc.format_message() + hint, exc.exit_code)
        except (click.ClickException, ApiError) as exc:
            _fail(str(exc.message), exc.exit_code)
        except click.Abort:
            _fail("aborted", 1)
        except ModuleNotFoundError as exc:
            if (exc.name or "").partition(".")[0] not in SERVER_PACKAGES:
                raise
            _fail(f"this needs the server install ({exc.name} is missing): pip install 'compilesvc[server]'", 2)
        except ValueError as exc:
            from compilesvc.signing.keys import KeyFileError  # here: most commands never load cryptography

            if not isinstance(exc, KeyFileError):
                raise
            _fail(f"the signing key cannot be used: {exc}", 2)
        except OSError as exc:
            if exc.errno != errno.EPIPE:
                raise
            # The reader went away (`compilesvc key … | head -c1`): say nothing, as click does, and keep
            # Python's exit-time flush of stdout from failing a second time.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(1)
        # In non-standalone mode click returns the exit code of ctx.exit()/--help, or the callback's result
        # (None for every command here).
        sys.exit(result if isinstance(result, int) else 0)


def _is_no_args_help(exc: click.UsageError) -> bool:
    # click >= 8.2 raises NoArgsIsHelpError for a group run without a command; 8.1 prints help itself.
    no_args = getattr(click.exceptions, "NoArgsIsHelpError", None)
    return no_args is not None and isinstance(exc, no_args)


def _fail(message: str, code: int) -> NoReturn:
    click.echo(f"error: {_one_line(message)}", err=True)
    sys.exit(code)


def _settings() -> Settings:
    # Imported when a command reads settings: `--help` and the client's commands never load pydantic-settings.
    from pydantic import ValidationError

    from compilesvc.config.settings import Settings

    try:
        return Settings()
    except ValidationError as exc:
        errors = "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors(include_url=False)
        )
        raise click.UsageError(f"invalid COMPILESVC_* settings: {errors}") from None


@contextlib.contextmanager
def ledger_services() -> Iterator[Services]:
    """The services of a command that works on the ledger itself (``gc``, ``tokens --ledger``,
    ``sign-artifacts``), closed afterwards. Run outside the directory of a ``compilesvc dev``, the embedded
    default would make an empty ledger and fail on its first query: a ledger that is not there, or has no
    tables yet, is refused first, creating nothing."""
    settings = _settings()
    if not settings.database_url:
        path = (settings.data_dir / "compilesvc.db").resolve()
        if not path.is_file():
            raise BadInput(f"no ledger at {path}: run this in the directory `compilesvc dev` runs in (its data is "
                           "in ./.compilesvc), or set COMPILESVC_DATABASE_URL and COMPILESVC_STORE_URL to your "
                           "service's")
    from sqlalchemy import inspect

    from compilesvc.services import Services

    services = Services.from_settings(settings)
    try:
        if not inspect(services.engine).has_table("alembic_version"):
            where = services.engine.url.render_as_string(hide_password=True)
            raise BadInput(f"the ledger at {where} has no tables: run `compilesvc migrate` against it first")
        yield services
    finally:
        services.close()


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """compilesvc: compile artifacts for AWS Neuron (inf2/trn) and CPU targets."""


def model_sha256(spec: CompileSpec, settings: Settings | None = None) -> str:
    """The content identity of the spec's model (what the key names instead of the URI), computed exactly as
    the service computes it (:func:`compilesvc.pinning.identity.content_sha256_for_key`)."""
    return model_identity(spec, settings)[0]


def model_identity(spec: CompileSpec, settings: Settings | None = None) -> tuple[str, CheckpointMaterial | None]:
    """:func:`model_sha256` and, for an hf-checkpoint, the checkpoint's key material (its config.json; its weights'
    digests when the compile pre-shards them), pinned as the service pins them."""
    # Only `key` with a model loads these (the store and boto3 come with them): start-up cost, not a cycle.
    from compilesvc.pinning.identity import identity_for_key
    from compilesvc.pinning.pins import ModelRefError
    from compilesvc.spec.keys import presharded

    uri = spec.model.uri
    try:
        return identity_for_key(spec.model, settings or _settings(),
                                weight_digests=spec.backend == "nxdi" and presharded(spec), sdk=spec.sdk)
    except ModelRefError as exc:
        unreadable = spec.model.format != "hf-checkpoint" or exc.message.startswith("cannot read")
        if uri.startswith("file://") and unreadable:
            # a file on this machine that cannot be read: exit 1, like any I/O error
            raise CommandFailed(f"cannot read model file: {exc.message}") from None
        raise BadInput(str(exc)) from None  # a client mistake (no such object, a prefix, not a checkpoint): exit 2
    except click.ClickException:
        raise
    except Exception as exc:  # S3 outages, credentials: one error line, exit 1
        raise CommandFailed(f"cannot identify model {uri}: {type(exc).__name__}: {exc}") from None


def _check_isa(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and not ISA_RE.fullmatch(value):
        raise click.BadParameter("expected <arch>-<level>, e.g. x86_64-avx512", ctx=ctx, param=param)
    return value


@main.command("key")
@click.argument("spec_path", metavar="SPEC", type=click.Path(dir_okay=False, path_type=str))
@click.option("--explain", "explain_", is_flag=True, help="Show every key component and its value.")
@click.option("--json", "as_json", is_flag=True, help="Print {key, schema, buckets, components} as JSON.")
@click.option(
    "--isa",
    metavar="ISA",
    callback=_check_isa,
    help="ISA for cpu aotinductor specs that name none (default: this host's, e.g. x86_64-avx512).",
)
@click.option("--salt", metavar="S", help="Key salt (default: COMPILESVC_KEY_SALT, else empty).")
def key_command(spec_path: str, explain_: bool, as_json: bool, isa: str | None, salt: str | None) -> None:
    """Print the artifact key of the spec in SPEC (.json, .yaml or .yml).

    The key names the model by content: blob:sha256: URIs carry it, file:// models are hashed here,
    s3:// models are looked up in S3.
    """
    if explain_ and as_json:
        raise click.UsageError("--explain and --json exclude each other")
    # The service's settings (COMPILESVC_*, else the defaults): the same element bounds as a submit, and
    # the key salt.
    settings = _settings()
    try:
        spec = load_spec_file(spec_path, settings.element_limits, settings.extra_flags)
    except SpecError as exc:
        raise SpecUsageError(spec_path, exc) from None
    if salt is None:
        salt = settings.key_salt
    if isa is None:
        isa = host_isa()
    sha, checkpoint = model_identity(spec, settings)
    try:
        keys = compute_keys(spec, model_sha256=sha, default_isa=isa, salt=salt, checkpoint=checkpoint)
    except ValueError as exc:  # a model identity that is not a digest (from a lookup) or an unusable ISA
        raise CommandFailed(str(exc)) from None
    if as_json:
        click.echo(json.dumps(keys.as_json(), indent=2, sort_keys=True))
    elif explain_:
        click.echo("\n".join(explain(keys)))
    else:
        click.echo(keys.key)


@main.command("migrate")
@click.option(
    "--database-url", metavar="URL", help="SQLAlchemy URL (default: COMPILESVC_DATABASE_URL, else SQLite in data_dir)."
)
@click.option("--grant-api", metavar="ROLE", help="Then grant this Postgres role the API's rights (row access).")
@click.option("--grant-worker", metavar="ROLE",
              help="Then grant this Postgres role the workers' rights (rows, but no tokens or sessions).")
def migrate_command(database_url: str | None, grant_api: str | None, grant_worker: str | None) -> None:
    """Upgrade the ledger database to the newest schema (alembic upgrade head); with --grant-api and
    --grant-worker, grant those roles their rights on every table (compilesvc/ledger/roles.py)."""
    if (grant_api is None) != (grant_worker is None):
        raise click.UsageError("--grant-api and --grant-worker go together")
    # SQLAlchemy and Alembic load for `migrate` alone: the client's commands share this module.
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    url = database_url or _settings().resolved_database_url
    try:
        parsed = make_url(url)
        parsed.get_dialect()  # an unknown scheme is the caller's mistake (exit 2), not a failed migration
    except (ArgumentError, NoSuchModuleError) as exc:
        raise click.BadParameter(str(exc), param_hint="'--database-url'") from None
    if parsed.drivername.startswith("sqlite") and parsed.database not in (None, "", ":memory:"):
        # Embedded mode on a fresh checkout: the data_dir may not exist yet, and SQLite won't create it.
        try:
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CommandFailed(f"cannot create a directory for {parsed.database}: {exc.strerror}") from None
    from compilesvc.ledger.migrate import upgrade

    try:
        upgrade(url)
    except Exception as exc:  # driver, network and migration errors alike: one line, exit 1
        raise CommandFailed(f"migration failed: {type(exc).__name__}: {exc}") from None
    click.echo(f"migrated {parsed.render_as_string(hide_password=True)} to head")
    if grant_api is not None and grant_worker is not None:
        from sqlalchemy import create_engine

        from compilesvc.ledger.roles import grant

        if not parsed.drivername.startswith("postgresql"):
            raise BadInput("--grant-api/--grant-worker need a Postgres ledger (SQLite has no roles)")
        engine = create_engine(url)
        try:
            grant(engine, grant_api, grant_worker)
        except ValueError as exc:
            raise BadInput(str(exc)) from None
        except Exception as exc:  # a role that does not exist, no right to grant: one line, exit 1
            raise CommandFailed(f"granting failed: {type(exc).__name__}: {exc}") from None
        finally:
            engine.dispose()
        click.echo(f"granted {grant_api} (api) and {grant_worker} (worker) their rights")


@main.command("version")
def version_command() -> None:
    """Print the compilesvc version and the artifact key schema."""
    try:
        version = metadata.version("compilesvc")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
        version = compilesvc.__version__
    click.echo(f"compilesvc {version} (key schema {KEY_SCHEMA})")
