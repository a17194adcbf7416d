"""What this host can compile and whether it works: toolchain versions and capabilities, ``compilesvc
doctor``, and the load check.

The package spans the workers' layers (pyproject's contract): ``versions`` sits below the backends, which read
it, and imports only :mod:`workers.isolation`; the doctor, which runs a whole compile, sits above them.
"""
