"""chatplane: control_plane."""
