"""Flask API and web UI: a blueprint per resource, over the compilesvc core.

``create_app`` is imported lazily so that ``compilesvc serve --help`` does not load Flask and the core.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from web.server.app import create_app

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from web.server.app import create_app

        return create_app
    raise AttributeError(f"module 'web' has no attribute {name!r}")
