"""``python -m projections``: run one admission processor instance (several split the partitions)."""

from projections.processor import main

main()
