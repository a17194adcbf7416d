"""Model identity: a spec's ``model.uri`` pinned to immutable bytes with a known sha256 (uploads, local
files, S3 object versions), and fetched again by that pin.

May import config, spec, store and the ledger.
"""
