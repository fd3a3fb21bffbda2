"""chatplane: projections."""
