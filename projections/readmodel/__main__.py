"""``python -m projections.readmodel``: run the ledger -> Cassandra read-model projection."""

import sys

from projections.readmodel.writer import main

sys.exit(main())
