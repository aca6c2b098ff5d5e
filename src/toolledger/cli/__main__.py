"""``python -m toolledger.cli``: the same as the ``toolledger`` command."""

from toolledger.cli import main

main()
