"""Engine bookkeeping without torch: requests, block pool, KV cache manager, scheduler."""
