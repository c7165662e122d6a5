"""Paged KV cache: a buddy page allocator per tier, block-size policies, the prefix cache, the manager."""

from engine.kv.manager import KVAllocation, KVCacheManager, KVStats, SwapPlan
from engine.kv.policy import BlockSizePolicy

__all__ = ["BlockSizePolicy", "KVAllocation", "KVCacheManager", "KVStats", "SwapPlan"]
