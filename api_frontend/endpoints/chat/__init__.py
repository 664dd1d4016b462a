"""POST /v1/chat/completions (and its render)."""
