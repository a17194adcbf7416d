"""The HTTP server around the views: the app factory (:mod:`.app`), ``compilesvc serve`` and its gunicorn
worker that answers problems for crashed requests, trusted proxies, security headers, submit rate limits and
the Prometheus metrics.

May import the core, :mod:`web.contract`, and the view packages it registers (:mod:`web.api`, :mod:`web.ui`).
"""
