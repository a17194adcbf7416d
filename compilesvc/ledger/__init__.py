"""The SQL ledger: typed tables (:mod:`compilesvc.ledger.models`) shared by every process."""
