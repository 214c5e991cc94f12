"""`python -m fusedamp.demo`: runs the demo (see fusedamp/demo/__init__.py)."""

from fusedamp.demo.cli import main

main()
