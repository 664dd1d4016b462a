"""Model code: shared blocks, one switchable decoder, and the architecture registry."""
