"""The KV cache, from the bookkeeping down to the bytes (as SGLang's memory_pool.py names its levels):

1. `blocks.BlockPool`: block ids. Which blocks are free, reference counts, and the published prompt blocks rows share
   (keyed by the previous block and the block's tokens). Host-only ints; no tensors.
2. Block tables: each row's list of block ids (`engine.request.Row.blocks`), sent to the device per step as a
   `[rows, max_blocks]` int32 tensor with each row's key limit.
3. `pools.KVPool`: the tensors, one pool per model (the target's, the draft's context): `[L, N, Hkv, bs, D]`, block 0
   the null block that padding rows write into.
4. Attention over a row's own blocks (`pools.paged_attention` and friends; the CUDA kernel is
   `backend/paged_triton.py`).

Imports the backend only."""
