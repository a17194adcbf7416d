"""One compile attempt on a worker: claim, fetch the pinned model, compile in the isolated child, publish or
fail (:mod:`.runner`), with the lease heartbeat, retries that ride out the ledger or the store, the log
stream, work directories, what a sandbox limit that was hit means, failure classification and the model
loading the child does.

May import the core, :mod:`workers.isolation` and :mod:`workers.backends`.
"""
