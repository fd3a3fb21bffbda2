"""chatplane: edge."""
