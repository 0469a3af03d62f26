"""evictlab: exact analysis of KV-cache eviction."""
__version__ = "0.1.0"
