"""Where the command-line client finds the API and its token.

The token comes from ``COMPILESVC_TOKEN``, else from the config file, never from a command-line argument
(which would land in shell history and in ``ps``). The API URL comes from ``--api``, else
``COMPILESVC_API_URL``, else the config file, else the embedded default.

The config file is ``$COMPILESVC_CONFIG``, else ``$XDG_CONFIG_HOME/compilesvc/config.toml``, else
``~/.config/compilesvc/config.toml``::

    api_url = "https://compilesvc.example.com"
    token = "csvc_..."
    trusted_keys = ["/etc/compilesvc/keys"]   # public keys fleets verify signatures with (docs/fleet.md)

A file holding a token that other users may read is refused, as ssh refuses such a key.
"""

from __future__ import annotations

import os
import stat
import tomllib
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

DEFAULT_API = "http://127.0.0.1:8080"
TOKEN_ENV = "COMPILESVC_TOKEN"
API_ENV = "COMPILESVC_API_URL"
CONFIG_ENV = "COMPILESVC_CONFIG"


class ConfigError(ValueError):
    """The config file cannot be used (unreadable, not TOML, wrong types, readable by others), or the API
    URL is not an http(s) URL."""


def config_path() -> Path:
    explicit = os.environ.get(CONFIG_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "compilesvc" / "config.toml"


@dataclass(frozen=True)
class ClientConfig:
    api_url: str
    token: str | None
    #: Where each value came from, for messages ("COMPILESVC_TOKEN", the file's path, "default").
    api_source: str
    token_source: str | None


def _read_file(path: Path) -> dict[str, object]:
    try:
        raw = path.read_bytes()
        mode = path.stat().st_mode
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path} is not TOML: {exc}") from None
    for name in ("api_url", "token"):
        if name in data and not isinstance(data[name], str):
            raise ConfigError(f"{path}: {name} must be a string")
    keys = data.get("trusted_keys")
    if keys is not None and not (isinstance(keys, str) or (isinstance(keys, list)
                                                         and all(isinstance(k, str) for k in keys))):
        raise ConfigError(f"{path}: trusted_keys must be a path or a list of paths")
    if "token" in data and mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{path} holds a token and other users may read it; run: chmod 600 {path}")
    return data


def load(api_option: str | None = None) -> ClientConfig:
    """The API URL (``api_option`` first) and the token, from the environment and the config file."""
    path = config_path()
    env_token = os.environ.get(TOKEN_ENV, "").strip()
    env_api = os.environ.get(API_ENV, "").strip()
    # The file is read only when something is still missing: a CI job with both variables set never
    # depends on a stray file of the runner's.
    file: dict[str, object] = {} if env_token and (api_option or env_api) else _read_file(path)
    if api_option:
        api, api_source = api_option, "--api"
    elif env_api:
        api, api_source = env_api, API_ENV
    elif isinstance(file.get("api_url"), str):
        api, api_source = str(file["api_url"]), str(path)
    else:
        api, api_source = DEFAULT_API, "default"
    _check_url(api, api_source)
    token: str | None
    if env_token:
        token, token_source = env_token, TOKEN_ENV
    elif isinstance(file.get("token"), str) and str(file["token"]).strip():
        token, token_source = str(file["token"]).strip(), str(path)
    else:
        token, token_source = None, None
    return ClientConfig(api_url=api, token=token, api_source=api_source, token_source=token_source)


def _check_url(url: str, source: str) -> None:
    """An API URL the client can use: http or https, with a host. ``api.example.com:8080`` would otherwise
    fail as an unreachable address after the retries (exit 3, "try again") when it is a typo to fix."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (a port that is not a number raises here)
    except ValueError as exc:
        raise ConfigError(f"the API URL {url!r} (from {source}) is not a URL: {exc}") from None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"the API URL {url!r} (from {source}) needs http:// or https:// and a host, "
                          f"e.g. https://compilesvc.example.com")


def trusted_key_paths() -> tuple[list[str], str] | None:
    """The ``trusted_keys`` of the config file (paths of PEM public keys or directories of them) and the
    file's path; None when the file names none. :mod:`compilesvc.signing.keys` reads the environment first."""
    path = config_path()
    keys = _read_file(path).get("trusted_keys")
    if keys is None:
        return None
    return ([keys] if isinstance(keys, str) else [str(k) for k in keys] if isinstance(keys, list) else []), str(path)
