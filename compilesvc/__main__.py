"""``python -m compilesvc``: the same CLI as the ``compilesvc`` console script."""

from compilesvc.cli.main import main

main()
