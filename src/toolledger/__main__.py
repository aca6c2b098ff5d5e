"""``python -m toolledger``: the same as the ``toolledger`` command."""

from toolledger.cli import main

main()
