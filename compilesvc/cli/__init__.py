"""Every ``compilesvc`` command: the command line's root (:mod:`.main`), the CI client (submit, status,
logs, cancel, retry, builds), fetch and verify for fleet hosts, operator commands (tokens, gc, pins,
campaigns, sign-artifacts, neuron-releases) and the long-running processes (``relay``, ``dev``).

The top layer: may import any core package. The client commands load neither SQLAlchemy nor boto3 at start
(tests/test_client_imports.py); server-side modules are imported inside the commands that need them.
"""
