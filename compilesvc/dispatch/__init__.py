"""Dispatch to Celery: queue names and routing, the transactional outbox and its relay, the embedded
filesystem broker, and the registry of live workers and the queues they consume.

May import access (team reads), config, spec and the ledger.
"""
