"""The life of one bucket compile on the server side: its rows shared by submit, control and the lease
holders, fenced leases, the failure history and retry delays, publishing to the store, compile logs, the
reconciler of ledger and broker, and the reaper that recovers what crashes left.

May import services, notify, lifecycle, dispatch, signing, pinning, access, spec, store and the ledger.
"""
