"""POST /v1/completions (and its render)."""
