"""`python -m fusedamp.demo`: the demo's command line (see fusedamp/demo/__init__.py)."""

from fusedamp.demo import main

main()
