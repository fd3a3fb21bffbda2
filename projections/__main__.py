"""``python -m projections``: run one admission processor instance (several split the partitions)."""

from projections.ledger.processor import main

main()
