"""``python -m projections.slo``: the SLO report (projections/slo/report.py)."""

import sys

from projections.slo.report import main

sys.exit(main())
