"""The memory tier: a keeper process that holds the newest in-memory snapshot of a rank and
outlives its trainer (docs/memory_tier.md)."""
