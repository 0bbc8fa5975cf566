"""KV-cache blocks, the free queue, and the prefix-cache map from block hash to block."""

from __future__ import annotations

# A full block's prefix-cache key: kv_cache_manager.block_key's 32-byte SHA-256 digest.
BlockHash = bytes


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None  # set once the block is full and cached
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None


class FreeBlockQueue:
    """Doubly linked list of blocks with ref_cnt == 0, in eviction order.

    Invariants:
    - a block is in the queue iff its ref_cnt is 0;
    - the head is the next block to hand out (and so to evict, if it holds a cached hash);
      freed blocks go to the tail, so cached blocks are evicted least recently used first;
    - `remove` unlinks a block from the middle in O(1) (a prefix-cache hit on a free block).
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free, block.prev_free = block, prev
            prev = block
        prev.next_free, self._tail.prev_free = self._tail, prev

    def popleft(self, count: int) -> list[KVCacheBlock]:
        """The first `count` blocks, unlinked together (one relink of the head)."""
        if count > self.num_free:
            raise ValueError(f"cannot allocate {count} blocks, {self.num_free} free")
        blocks = []
        block = self._head.next_free
        for _ in range(count):
            blocks.append(block)
            next_block = block.next_free
            block.prev_free = block.next_free = None
            block = next_block
        self._head.next_free, block.prev_free = block, self._head
        self.num_free -= count
        return blocks

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, "block is not in the free queue"
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free += 1


class BlockPool:
    """Owns every block. Allocation takes from the free queue's head and, if that block still
    holds a cached hash, evicts it from the hash map first. Block 0 is never handed out: it is
    the padding slot target, so a stray write never lands in a live block, and the null block
    that replaces blocks freed outside a sliding window."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2 (one is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Stands in a request's block list for blocks freed outside a sliding window.
        self.null_block = self.blocks[0]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        # Bumped whenever `cached_blocks` gains or loses an entry: a prefix lookup made at the
        # same version would find the same blocks.
        self.cache_version = 0

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        blocks = self.free_queue.popleft(num_blocks)
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: list[KVCacheBlock]) -> None:
        """Drop a reference. Callers pass a request's blocks tail first, so the tail of a
        sequence (least likely to be shared) is evicted before its prefix."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash], start: int, stop: int) -> None:
        """Enter `blocks[i]` under `block_hashes[i]` for i in start..stop-1: each block that is
        not the null block, not cached yet, and whose hash no other block holds (an identical
        block cached already: this one stays private)."""
        cached_blocks, null, added = self.cached_blocks, self.null_block, 0
        for i in range(start, stop):
            block, block_hash = blocks[i], block_hashes[i]
            if block.block_hash is None and block is not null and block_hash not in cached_blocks:
                block.block_hash = block_hash
                cached_blocks[block_hash] = block
                added += 1
        self.cache_version += added

    def uncache(self, blocks: list[KVCacheBlock]) -> None:
        """Forget these blocks' hashes (they stay where they are in the free queue)."""
        for block in blocks:
            self._evict(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.free_queue.num_free != self.num_usable_blocks:
            return False
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        self.cache_version += 1
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
                self.cache_version += 1
            block.block_hash = None
