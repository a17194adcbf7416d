"""The HTTP client of compilesvc's own API (:mod:`.api`), where the command line finds the API and its
token (:mod:`.config`), and following a build from the client side (:mod:`.follow`).

Light by contract: may import only :mod:`compilesvc.spec` and :mod:`compilesvc.states` (import-linter forbids
the ledger, SQLAlchemy, Flask and Celery): CI runners and fleet hosts install the client alone.
"""
