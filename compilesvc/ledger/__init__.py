"""The SQL ledger: typed tables shared by every process (:mod:`compilesvc.ledger.models`, and the tables of
webhooks, campaigns, retention and UI sessions in modules of their own), engines tuned per backend
(:mod:`.engine`), the SQLite writer, migrations and Postgres roles, state-transition events with their
subscribers (:mod:`.events`), and the group-committed build rows (:mod:`.build_records`).

The bottom of the server side: may import only :mod:`compilesvc.states`.

Every table module is imported here, so whichever ledger module a process imports first, the whole schema is
on ``Base.metadata`` (foreign keys between modules resolve, and migrations compare every table).
"""

from compilesvc.ledger import campaigns, models, retention, ui_sessions, webhooks

__all__ = ["campaigns", "models", "retention", "ui_sessions", "webhooks"]
