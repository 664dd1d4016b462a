"""The shared KV store role: full prefix blocks any replica computed, for every replica."""
