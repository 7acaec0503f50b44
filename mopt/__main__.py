"""`python -m mopt`."""

from mopt.cli import main

main()
