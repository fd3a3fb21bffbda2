"""Reports read from the log and the read models: the SLO report (``slo``) and the analysts' usage
report (``usage``)."""
