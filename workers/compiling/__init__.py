"""One compile attempt on a worker: claim, fetch the pinned model, compile in the isolated child, publish or
fail (:mod:`.runner`), with the lease heartbeat, retries that ride out the ledger or the store, the log
stream, work directories, what a sandbox limit that was hit means; and what the attempt shares with its
child: the contract (request, results, failures, exit codes), failure classification and model loading.

May import the core, :mod:`workers.host.versions` and :mod:`workers.isolation`; never the backends (the
child runs them, by name).
"""
