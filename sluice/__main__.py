"""`python -m sluice` runs the CLI (what `sluice up` uses to start its children)."""

from sluice.cli import main

main()
