"""Pooling-model scoring: /v1/score, and what /v1/rerank and /classify share (pool.py)."""
