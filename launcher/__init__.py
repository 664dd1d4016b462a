"""The launcher: what starts, checks and supervises the processes of a node (``candor``).

Nothing in a role imports from here; it may import every package but bench and tests.
"""
