"""``python -m projections.audit``: the ledger audit (``projections.ledger.audit``; same arguments)."""

import sys

from projections.ledger.audit import main

if __name__ == "__main__":
    sys.exit(main())
