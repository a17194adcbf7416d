"""An artifact's life after it is built: its state and the builds following it, retention and garbage
collection, roll-forward campaigns, and fetch counts.

May import pinning, access, config, spec, store and the ledger; notify and everything above subscribe to it.
"""
