"""`python -m lf_adapter.cli`: the `lfa` command."""

from . import main

main()
