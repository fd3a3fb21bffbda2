"""Content checks on a request's messages (the operator's policy), run by the edge before admission."""
