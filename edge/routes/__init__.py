"""Routes of the edge, one module per resource."""
