"""Who may do what: API tokens and their principals, UI sessions, idempotency keys, and the team
boundary for reads.

May import the ledger, :mod:`compilesvc.states` and :mod:`compilesvc.refusals`; nothing above them.
"""
