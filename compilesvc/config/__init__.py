"""Settings: every process's :class:`Settings`, read once from ``COMPILESVC_*``, and the refusal of the
placeholder secrets a deployment kept. ``compilesvc.config.Settings`` is public (docs and users name it).

May import :mod:`compilesvc.spec` (spec limits) and :mod:`compilesvc.hostinfo`; nothing that needs a ledger.
"""

from compilesvc.config.settings import Settings

__all__ = ["Settings"]
