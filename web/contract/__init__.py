"""The API's contract with its clients: request and response models, reading bodies, queries and headers
against them, RFC 9457 problems, and the OpenAPI layer that declares each operation, validates its request and
generates ``/openapi.json``.

May import the core's spec and states, and :mod:`web.context`; never a view.
"""
