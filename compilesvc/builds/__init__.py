"""Builds: a submit turned into a hit, a join or new compiles (admission, the rows it writes, joins of
identical submits in flight, changes to an existing set), where each bucket came from (provenance), and a
build's control (cancel, retry).

The top of the write path: may import every core package below it (compiles, services, notify, lifecycle,
pinning, dispatch, access, spec, store, ledger); only the CLI and web/ import it.
"""
