"""POST /v1/embeddings on a pooling model."""
