"""``python -m projections.history``: run the history writer (projections/history/writer.py)."""

import sys

from projections.history.writer import main

sys.exit(main())
