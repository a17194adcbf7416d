"""What engineers read: build history, service statistics, why a build missed the cache (key diff), and
the artifact index.

Read-only over the ledger: may import lifecycle, access, spec and the ledger; only web/ and the CLI import it.
"""
