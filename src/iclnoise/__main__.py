"""`python -m iclnoise ...`: the iclnoise command (iclnoise.cli)."""
from .cli import main

main()
