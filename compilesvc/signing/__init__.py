"""Signing what the service publishes: signing keys and trusted keys, DSSE statements in Sigstore
bundles (:mod:`.keys`), and what an artifact's signature says and how a fleet checks it (:mod:`.artifacts`).

Used by the fleet library: may import only client (trusted keys in the client config) and spec.
"""
