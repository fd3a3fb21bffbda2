"""chatplane: schemas."""
