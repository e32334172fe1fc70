"""Stage-4 extensions of the KV layer (course chapters 11–14): allocators, eviction policies, defragmentation."""
