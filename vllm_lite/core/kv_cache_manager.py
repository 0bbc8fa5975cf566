"""Per-request KV block allocation and prefix-cache lookup."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from vllm_lite.bookkeeping import native_loops
from vllm_lite.lora.request import LoRARequest
from vllm_lite.core.block_pool import BlockHash, BlockPool, KVCacheBlock
from vllm_lite.core.request import Request
from vllm_lite.wire import ImageInputs

# The parent key of a request's first block when it has no cache_salt. Every key is a 32-byte
# SHA-256 digest, so a salted root (the digest of the salt) can equal this only by a preimage.
UNSALTED_ROOT_KEY: BlockHash = bytes(32)


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found cached


@dataclass(slots=True)
class TrackedBlockCounts:
    """The blocks held and the blocks registered in the prefix cache by each request of one id
    list (the scheduler's running requests), as arrays: a decode step reads them for the whole
    batch without a lookup per request. The manager updates a tracked request's entry whenever
    it changes that request's blocks, so the arrays stay true until another list is tracked."""

    req_ids: list[str]
    position: dict[str, int]
    held: np.ndarray
    cached: np.ndarray


class KVCacheManager:
    """Maps each request to its blocks. A full block is identified by a chained key
    `sha256(parent key || its int32 tokens)`: 32-byte parent, fixed-size token bytes, so equal
    keys mean equal whole prefixes (and equal cache_salt) unless SHA-256 collides. A block enters
    the cache once its tokens are all known (not placeholders) and scheduled (their KV is written
    in that step, before any later step can read it), at the first of: the request's admission
    (`allocate_slots` with a sliding window: every allocation), the scheduler's call before a
    prefix lookup (`register_filled_blocks`: so a lookup finds every block it would had each
    been registered the step it filled), the request freeing its blocks. A decode step that only
    fills blocks does no prefix-cache work: a request's decode blocks are keyed together, once."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 sliding_window: int | None = None, native: bool | None = None,
                 drop_last_hit_block: bool = False) -> None:
        """`native`: whether prefix-cache keys are computed by csrc's SHA-256 (`block_keys`; None:
        where it is built and the CPU has SHA extensions; True: it must be), else by hashlib.
        `drop_last_hit_block` (an EAGLE head, vLLM's rule): a hit leaves its last block out, to be
        computed again: the head's entry at a block's last position was written with the token
        after it, which the next block holds and the block's key does not."""
        native_keys = native_loops is not None and native_loops.sha256_extensions()
        if native and not native_keys:
            raise RuntimeError("csrc's block keys need vllm_lite._bookkeeping built and a CPU with SHA extensions")
        self._native: ModuleType | None = native_loops if native_keys and native is not False else None
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window  # set only when every layer slides
        self.drop_last_hit_block = drop_last_hit_block
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()
        self.tracked = TrackedBlockCounts([], {}, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_usable_blocks

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks. At most num_tokens - 1 tokens can hit: the last
        token must be computed to produce logits. A request with skip_reading_prefix_cache reads
        none (vLLM's; the default for one that wants prompt logprobs: every prompt position must
        go through the model). A request blocked
        at the head of the queue asks every step: the answer is kept until the cached set of
        blocks changes."""
        if not self.enable_caching or request.sampling_params.skip_reading_prefix_cache:
            return [], 0
        version = self.block_pool.cache_version
        if request.prefix_lookup is not None and request.prefix_lookup[0] == version:
            return request.prefix_lookup[1], request.prefix_lookup[2]
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        if self.drop_last_hit_block:
            hits = hits[:-1]
        request.prefix_lookup = (version, hits, len(hits) * self.block_size)
        return hits, len(hits) * self.block_size

    def record_admission(self, request: Request, num_cached_tokens: int) -> None:
        """Counts one prefix-cache query per admission (not per step a request waits)."""
        request.prefix_lookup = None
        if self.enable_caching and not request.sampling_params.skip_reading_prefix_cache:
            self.stats.queries += request.num_tokens
            self.stats.hits += num_cached_tokens

    def fits_held_blocks(self, request: Request, num_tokens: int) -> bool:
        """Whether `request`'s first `num_tokens` tokens fit in the blocks it holds:
        `allocate_slots` would change nothing. Most decode steps; the scheduler's per-request
        check, so it stays a dict lookup (the same rule for a whole batch: `held_blocks`)."""
        if self.sliding_window is not None:
            return False
        blocks = self.req_to_blocks.get(request.request_id)
        return blocks is not None and num_tokens <= len(blocks) * self.block_size

    def held_blocks(self, req_ids: list[str]) -> np.ndarray | None:
        """`fits_held_blocks` for many requests at once: request `req_ids[i]` holds the result's
        [i] blocks, so its first n tokens fit when n <= that times `block_size` (read only; the
        caller compares). None where the per-request rule must decide: a sliding window, or a
        request holding no blocks. The counts come from `tracked`, which follows `req_ids` from
        here on (read again only when the list changes; the list is kept, not copied: the
        scheduler's list of running ids, never changed once made, so that a steady step's check
        is `is`)."""
        if self.sliding_window is not None or not self._tracks(req_ids):
            return None
        return self.tracked.held

    def _tracks(self, req_ids: list[str]) -> bool:
        """Whether `tracked` follows `req_ids` (made to, if it can)."""
        return self.tracked.req_ids is req_ids or self.tracked.req_ids == req_ids or self._track(req_ids)

    def _track(self, req_ids: list[str]) -> bool:
        """Track these requests' block counts; False (tracking nothing new) when one of them
        holds no blocks."""
        held = list(map(self.req_to_blocks.get, req_ids))
        if None in held:
            return False
        self.tracked = TrackedBlockCounts(
            req_ids, {request_id: i for i, request_id in enumerate(req_ids)},
            np.fromiter(map(len, held), np.int64, len(held)),
            np.fromiter(map(self.num_cached_blocks.__getitem__, req_ids), np.int64, len(req_ids)))
        return True

    def _note_counts(self, request_id: str) -> None:
        """After a change to the request's blocks: its entry in `tracked`, if it has one."""
        position = self.tracked.position.get(request_id)
        if position is not None:
            blocks = self.req_to_blocks.get(request_id)
            self.tracked.held[position] = 0 if blocks is None else len(blocks)
            self.tracked.cached[position] = self.num_cached_blocks.get(request_id, 0)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None) -> list[KVCacheBlock] | None:
        """Blocks for `num_new_tokens` more tokens after the computed ones; None if they don't fit
        (nothing else is changed then). Blocks that fell out of the sliding window are freed
        first, in either case."""
        if new_computed_blocks is None and self.sliding_window is None:
            blocks = self.req_to_blocks.get(request.request_id)
            if blocks is not None:
                # A running request (every decode step): no hits, no window; what the general
                # path below concludes, without its per-call lists and sums.
                num_tokens = request.num_computed_tokens + num_new_tokens
                num_new_blocks = -(-num_tokens // self.block_size) - len(blocks)
                new_blocks: list[KVCacheBlock] = []
                if num_new_blocks > 0:
                    if num_new_blocks > self.block_pool.get_num_free_blocks():
                        return None
                    new_blocks = self.block_pool.allocate(num_new_blocks)
                    blocks.extend(new_blocks)
                    self._note_counts(request.request_id)
                return new_blocks
        self.remove_skipped_blocks(request)
        computed = self._drop_hits_outside_window(request, new_computed_blocks or [])
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_tokens = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        num_required = -(-num_tokens // self.block_size)
        num_new_blocks = max(num_required - len(blocks) - len(computed), 0)
        # Hits on free blocks take them out of the free queue, so they don't count as free.
        null = self.block_pool.null_block
        num_free_hits = sum(1 for block in computed if block.ref_cnt == 0 and block is not null)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_free_hits:
            return None
        self.block_pool.touch([block for block in computed if block is not null])
        new_blocks = self.block_pool.allocate(num_new_blocks)
        if request.request_id not in self.req_to_blocks:
            self.req_to_blocks[request.request_id] = []
            self.num_cached_blocks[request.request_id] = len(computed)
        blocks = self.req_to_blocks[request.request_id]
        blocks.extend(computed)
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, num_tokens)
        self._note_counts(request.request_id)
        return new_blocks

    def allocate_running(self, rows: np.ndarray, requests: list[Request],
                         num_new_blocks: np.ndarray) -> list[KVCacheBlock]:
        """`allocate_slots` for each of `requests` in turn, for running requests (they hold
        blocks; no hits, no sliding window) whose new blocks the caller counted as free: request
        i, at position `rows[i]` of the list `held_blocks` was last asked about, gets
        `num_new_blocks[i]` (at least one) blocks. The same blocks, in the same order, as one
        call after another. Returns the new blocks, request after request."""
        tracked, req_to_blocks = self.tracked, self.req_to_blocks
        counts = num_new_blocks.tolist()
        taken = self.block_pool.allocate(sum(counts))  # in the order the calls would take them
        start = 0
        for request, count in zip(requests, counts):
            req_to_blocks[request.request_id].extend(taken[start:start + count])
            start += count
        tracked.held[rows] += num_new_blocks
        return taken

    def register_filled_blocks(self, req_ids: list[str], requests: list[Request], num_scheduled: np.ndarray,
                               num_known: np.ndarray) -> None:
        """The running requests `requests` (ids `req_ids`) register their blocks full of tokens
        both scheduled (request i's first `num_scheduled[i]`) and known (its first
        `num_known[i]`): before a prefix lookup, what registering every block in the step it
        filled would have registered by now (with a sliding window, `allocate_slots` did, every
        step). Python runs only for the requests that filled a block since they last
        registered; the registered counts come from `tracked`."""
        if not self.enable_caching or self.sliding_window is not None:
            return
        if not self._tracks(req_ids):  # (a request holding no blocks yet: one at a time)
            for request in requests:
                blocks = self.req_to_blocks.get(request.request_id)
                if blocks:
                    self._cache_full_blocks(request, blocks, request.num_computed_tokens)
                    self._note_counts(request.request_id)
            return
        tracked, req_to_blocks = self.tracked, self.req_to_blocks
        num_full = np.minimum(num_scheduled, num_known) // self.block_size
        registering = np.flatnonzero(num_full > tracked.cached)
        for i, full, known in zip(registering.tolist(), num_full[registering].tolist(),
                                  num_known[registering].tolist()):
            request = requests[i]
            self._register_full_blocks(request, req_to_blocks[request.request_id], full, known)
        tracked.cached[registering] = num_full[registering]

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def free(self, request: Request, uncache: bool = False) -> None:
        """`uncache`: for a request that failed, whose latest blocks may be cached without their
        KV ever written (the worker left it out of the step): its blocks that nobody else holds
        leave the prefix cache."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        if blocks and self.enable_caching and not uncache:  # (its blocks filled since it last registered)
            self._cache_full_blocks(request, blocks, request.num_computed_tokens)
        self.num_cached_blocks.pop(request.request_id, None)
        self._note_counts(request.request_id)
        null = self.block_pool.null_block
        blocks = [block for block in reversed(blocks) if block is not null]
        self.block_pool.free(blocks)
        if uncache:
            self.block_pool.uncache([block for block in blocks if block.ref_cnt == 0])

    def max_blocks_needed(self, num_tokens: int, max_chunk: int) -> int:
        """Most blocks a request of `num_tokens` tokens holds at once, computing at most
        `max_chunk` tokens a step: all of them, or with a sliding window the window's blocks
        plus the chunk's."""
        needed = -(-num_tokens // self.block_size)
        if self.sliding_window is None:
            return needed
        return min(needed, -(-(self.sliding_window - 1 + max_chunk) // self.block_size) + 1)

    def _drop_hits_outside_window(self, request: Request,
                                  hits: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """Prefix-cache hits the next query can no longer see are not taken: null blocks stand
        in for them (so a long cached prefix costs only its last window of blocks)."""
        if self.sliding_window is None or not hits:
            return hits
        first_needed = request.num_computed_tokens + len(hits) * self.block_size - self.sliding_window + 1
        num_skipped = min(max(first_needed, 0) // self.block_size, len(hits))
        return [self.block_pool.null_block] * num_skipped + hits[num_skipped:]

    def remove_skipped_blocks(self, request: Request) -> None:
        """With every layer sliding over `sliding_window` keys, the next query (position
        `num_computed_tokens`) and all later ones see keys from `num_computed_tokens - window + 1`
        on: blocks wholly before that are read by no layer again. They are freed (tail first)
        and replaced by the null block, so block i still covers tokens i*bs .. (i+1)*bs - 1.
        Invariant: a request's null blocks are a prefix of its block list."""
        blocks = self.req_to_blocks.get(request.request_id)
        if self.sliding_window is None or not blocks:
            return
        first_needed = max(request.num_computed_tokens - self.sliding_window + 1, 0)
        null = self.block_pool.null_block
        freed = []
        for i in range(min(first_needed // self.block_size, len(blocks)) - 1, -1, -1):
            if blocks[i] is null:
                break
            freed.append(blocks[i])
            blocks[i] = null
        self.block_pool.free(freed)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        """Registers the request's blocks that its first `num_tokens` slots fill with known tokens
        and that are not registered yet."""
        num_full = num_tokens // self.block_size
        if num_full <= self.num_cached_blocks[request.request_id]:  # (most steps: no block filled up)
            return
        # Slots are allocated for tokens still in flight (placeholders): a block is registered
        # once its tokens are known, at the request's next allocation.
        num_full = min(num_full, request.num_tokens // self.block_size)
        if num_full > self.num_cached_blocks[request.request_id]:
            self._register_full_blocks(request, blocks, num_full, request.num_tokens)

    def _register_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_full: int,
                              num_known: int) -> None:
        """Enter the request's blocks from its first unregistered one up to `num_full` (full of
        its first `num_known` tokens, which are known) in the prefix cache."""
        if len(request.block_hashes) < num_full:
            self._update_block_hashes(request, num_known)
        request_id = request.request_id
        self.block_pool.cache_blocks(blocks, request.block_hashes, self.num_cached_blocks[request_id], num_full)
        self.num_cached_blocks[request_id] = num_full

    def _update_block_hashes(self, request: Request, num_known: int | None = None) -> None:
        """Keys for every full block of the request's known tokens (`num_known`, read from the
        request when not given)."""
        hashes, bs = request.block_hashes, self.block_size
        num_known = request.num_tokens if num_known is None else num_known
        count = num_known // bs - len(hashes)
        if count > 0:
            parent = hashes[-1] if hashes else root_block_key(request.cache_salt, request.lora_request)
            start = len(hashes) * bs
            if request.prompt_embeds is not None and start < request.num_prompt_tokens:
                hashes.extend(extra_block_keys(parent, request.token_ids, start, count, bs,
                                               embeds_extra(request.prompt_embeds)))
            elif request.images is not None and start <= request.images.offsets[-1]:
                hashes.extend(extra_block_keys(parent, request.token_ids, start, count, bs,
                                               images_extra(request.images)))
            else:
                hashes.extend(block_keys(parent, request.token_ids, start, count, bs, self._native))


def root_block_key(cache_salt: str | None, lora: LoRARequest | None = None) -> BlockHash:
    """The parent key of the first block: the salt and the LoRA adapter (its id and folder) go
    into the first block's key only, and through the chain into every later one (as vLLM mixes
    `cache_salt` and the adapter into its block hashes): a prompt's KV under one adapter is
    never read under another, nor under an id reused for another folder."""
    if cache_salt is None and lora is None:
        return UNSALTED_ROOT_KEY
    salt = b"" if cache_salt is None else b"vllm_lite cache_salt\0" + cache_salt.encode()
    if lora is None:
        return hashlib.sha256(salt).digest()
    adapter = f"\0vllm_lite lora\0{lora.lora_int_id}\0{lora.lora_path}".encode()
    return hashlib.sha256(salt + adapter).digest()


def block_key(parent: BlockHash, token_bytes: bytes) -> BlockHash:
    """One full block's key: SHA-256 over the parent's 32-byte key and the block's int32 tokens."""
    return hashlib.sha256(parent + token_bytes).digest()


def extra_block_keys(parent: BlockHash, token_ids: np.ndarray, start: int, count: int, block_size: int,
                     extra: Callable[[int, int], bytes]) -> list[BlockHash]:
    """`block_keys` of a prompt whose inputs are more than its token ids (vLLM's extra keys): a
    block's key also covers `extra(first, end)`, the bytes its positions first..end - 1 add, so
    equal inputs share blocks and no other prompt does."""
    keys = []
    for first in range(start, start + count * block_size, block_size):
        data = token_ids[first:first + block_size].tobytes() + extra(first, first + block_size)
        parent = block_key(parent, data)
        keys.append(parent)
    return keys


def embeds_extra(prompt_embeds: np.ndarray) -> Callable[[int, int], bytes]:
    """A prompt given as input embeddings (its token ids placeholders): the SHA-256 of the
    block's embedding rows."""
    def extra(first: int, end: int) -> bytes:
        rows = prompt_embeds[first:end]
        return b"\0vllm_lite prompt_embeds\0" + hashlib.sha256(rows.tobytes()).digest() if len(rows) else b""
    return extra


def images_extra(images: ImageInputs) -> Callable[[int, int], bytes]:
    """A prompt with images: the hash of each image whose placeholders start in the block (the
    blocks after it hold it through the chain of keys)."""
    def extra(first: int, end: int) -> bytes:
        starting = np.flatnonzero((images.offsets >= first) & (images.offsets < end))
        return b"".join(b"\0vllm_lite image\0" + images.hashes[i] for i in starting.tolist())
    return extra


def block_keys(parent: BlockHash, token_ids: np.ndarray, start: int, count: int, block_size: int,
               native: ModuleType | None = None) -> list[BlockHash]:
    """The keys of `count` full blocks of `token_ids` (int32) from token `start` on, each the
    `block_key` of the one before (the first of `parent`). `native`: vllm_lite._bookkeeping,
    whose SHA-256 runs in the CPU's SHA instructions (a key ~0.8 us, where hashlib's, with
    OpenSSL's per-digest setup and the block's bytes copied twice, takes ~2.5); None: hashlib."""
    if native is not None:
        return native.block_keys(parent, token_ids, start, count, block_size)
    keys = []
    for first in range(start, start + count * block_size, block_size):
        parent = block_key(parent, token_ids[first:first + block_size].tobytes())
        keys.append(parent)
    return keys
