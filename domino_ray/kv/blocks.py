"""The host's book of a paged KV pool (`kv/pools.py`): free blocks, reference counts, shared prompt blocks.

A block is free, or held by the rows that reference it. Rows whose prompts start with the same whole blocks of tokens
share those blocks: a block of prompt tokens, once its keys are written (or being written by the forward the sharing
row joins), is *published* under the key (the block before it, its tokens), and a later row walks its prompt block by
block through that map. The key names the previous block by id, so a match is exact (no hash can collide): a block's
id stands for the whole prefix before it for as long as it is held, and a block leaves the map when its last holder
lets it go (a row holding a block holds every block before it, so a published block never outlives its prefix).
Freed blocks are not kept for later rows (no cache beyond the rows in flight).
"""

from __future__ import annotations

from dataclasses import dataclass

from domino_ray.kv.pools import NULL_BLOCK


@dataclass
class KVCacheStats:
    """The `kv_cache` object of a job's summary and Serve's metrics."""
    block_size: int
    blocks: int                 # usable blocks (the null block not counted)
    peak_blocks_used: int = 0
    peak_rows: int = 0          # most rows in flight at once (decoding or being prefilled)
    preemptions: int = 0        # rows that gave their blocks back mid-generation, re-prefilled later
    prefix_hit_tokens: int = 0  # prompt tokens not prefilled because their blocks were shared

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class BlockPool:
    """Blocks `1..num_blocks-1` of a pool of `block_size`-position blocks (block 0 is the null block)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.free: list[int] = list(range(num_blocks - 1, NULL_BLOCK, -1))  # a stack: low ids first
        self.refs = [0] * num_blocks
        self.published: dict[tuple[int, tuple[int, ...]], int] = {}  # (previous block or -1, tokens) -> block
        self.key_of: dict[int, tuple[int, tuple[int, ...]]] = {}
        self.stats = KVCacheStats(block_size, num_blocks - 1)

    @property
    def free_count(self) -> int:
        return len(self.free)

    @property
    def used(self) -> int:
        return self.stats.blocks - len(self.free)

    def blocks_for(self, positions: int) -> int:
        """Blocks that hold `positions` positions."""
        return -(-positions // self.block_size)

    def take(self, count: int) -> list[int]:
        """`count` free blocks, held once each (the caller checked `free_count`)."""
        if count > len(self.free):
            raise RuntimeError(f"{count} blocks asked, {len(self.free)} free")
        out = [self.free.pop() for _ in range(count)]
        for b in out:
            self.refs[b] = 1
        self.stats.peak_blocks_used = max(self.stats.peak_blocks_used, self.used)
        return out

    def release(self, blocks: list[int]):
        """A row lets its blocks go; a block nobody holds is free (and unpublished)."""
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                key = self.key_of.pop(b, None)
                if key is not None:
                    del self.published[key]
                self.free.append(b)

    def share_prefix(self, tokens: list[int], most: int) -> list[int]:
        """The published blocks `tokens` starts with, at most `most`, each now held once more."""
        bs, out, previous = self.block_size, [], -1
        for i in range(most):
            block = self.published.get((previous, tuple(tokens[i * bs:(i + 1) * bs])))
            if block is None:
                break
            self.refs[block] += 1
            out.append(block)
            previous = block
        return out

    def publish(self, tokens: list[int], blocks: list[int], start: int, stop: int) -> int:
        """Publish whole blocks `start..stop-1` of a row's `blocks` holding `tokens` (their keys written by now or by
        the forward a sharing row joins); returns `stop`. A block whose key is taken (the same prefix computed by
        another row) stays the row's own."""
        bs = self.block_size
        for i in range(start, stop):
            key = (blocks[i - 1] if i else -1, tuple(tokens[i * bs:(i + 1) * bs]))
            if key not in self.published and blocks[i] not in self.key_of:
                self.published[key] = blocks[i]
                self.key_of[blocks[i]] = key
        return stop
