"""What this host can compile and whether it works: toolchain versions and capabilities, ``compilesvc
doctor``, and the load check.

May import the core, :mod:`workers.isolation` and :mod:`workers.backends`.
"""
