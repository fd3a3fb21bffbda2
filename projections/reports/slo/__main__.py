"""``python -m projections.reports.slo``: the SLO report (projections/reports/slo/report.py)."""

import sys

from projections.reports.slo.report import main

sys.exit(main())
