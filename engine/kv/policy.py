"""Which block size a sequence's next block gets.

`fixed(N)`: every block holds N tokens. `dynamic`: short sequences get small blocks (little internal
waste), long ones big blocks (short block tables, fewer allocations): by default < 512 tokens -> 16,
512-2048 -> 32, else 64. The size is chosen by the position where the new block starts, so block
boundaries are a pure function of position — which keeps prefix-cache hashes stable across sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import CacheConfig


@dataclass(frozen=True, slots=True)
class BlockSizePolicy:
    kind: str
    fixed_size: int
    thresholds: tuple[int, int]
    sizes: tuple[int, int, int]

    @classmethod
    def from_config(cls, cfg: CacheConfig) -> BlockSizePolicy:
        low, high = cfg.dynamic_thresholds
        small, medium, large = cfg.dynamic_sizes
        return cls(cfg.block_policy, cfg.block_size, (low, high), (small, medium, large))

    @classmethod
    def fixed(cls, size: int) -> BlockSizePolicy:
        return cls("fixed", size, (512, 2048), (size, size, size))

    def size_at(self, position: int) -> int:
        """Tokens in the block that starts at token `position`."""
        if self.kind == "fixed":
            return self.fixed_size
        low, high = self.thresholds
        if position < low:
            return self.sizes[0]
        if position < high:
            return self.sizes[1]
        return self.sizes[2]

    def max_size(self) -> int:
        return self.fixed_size if self.kind == "fixed" else max(self.sizes)

    def layout(self, start: int, end: int) -> list[tuple[int, int]]:
        """(start, size) of the blocks that cover tokens [start, end), first block starting at `start`."""
        out = []
        pos = start
        while pos < end:
            size = self.size_at(pos)
            out.append((pos, size))
            pos += size
        return out

    @property
    def name(self) -> str:
        return f"fixed-{self.fixed_size}" if self.kind == "fixed" else "dynamic"
