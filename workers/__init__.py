"""chatplane: workers."""
