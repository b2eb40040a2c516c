"""The Triton kernels of asr/triton_attention.py (imported only where Triton runs)."""

import triton
import triton.language as tl


@triton.jit
def attend(Q, K, V, USED, OUT, PARTIAL, MAXIMA, SUMS,
           sq_n, sq_q, sq_h, sk_n, sk_h, sk_k, sv_n, sv_h, sv_k, so_n, so_q, so_h,
           heads, queries, capacity, chunk, scale,
           HAS_USED: tl.constexpr, CAUSAL: tl.constexpr, QUERIES: tl.constexpr, HEAD_DIM: tl.constexpr,
           BLOCK: tl.constexpr, SPLIT: tl.constexpr):
    """One row's head, QUERIES of its queries, over one split of its keys (program ids: row *
    heads + head, split, block of queries): an online softmax over blocks of BLOCK keys, in
    float32. SPLIT: writes the split's unnormalised output, maximum and sum for `combine`;
    else the output itself."""
    row_head = tl.program_id(0)
    split = tl.program_id(1)
    block = tl.program_id(2)
    row = (row_head // heads).to(tl.int64)  # offsets past 2**31 elements in a large batch's cache
    head = row_head % heads
    if HAS_USED:
        used = tl.load(USED + row)
    else:
        used = capacity
    begin = split * chunk
    end = tl.minimum(begin + chunk, used)

    q_index = block * QUERIES + tl.arange(0, QUERIES)
    d_index = tl.arange(0, HEAD_DIM)
    live = q_index < queries
    query = tl.load(Q + row * sq_n + head * sq_h + q_index[:, None] * sq_q + d_index[None, :],
                    mask=live[:, None], other=0.0)
    # A query's last key: used - queries + i with CAUSAL (the last query meets the last key).
    if CAUSAL:
        last = used - queries + q_index
    else:
        last = tl.zeros([QUERIES], tl.int32) + used - 1

    maximum = tl.full([QUERIES], float("-inf"), tl.float32)
    total = tl.zeros([QUERIES], tl.float32)
    acc = tl.zeros([QUERIES, HEAD_DIM], tl.float32)
    k_base = K + row * sk_n + head * sk_h
    v_base = V + row * sv_n + head * sv_h
    for start in range(begin, end, BLOCK):
        k_index = start + tl.arange(0, BLOCK)
        inside = k_index < end
        keys = tl.load(k_base + k_index[None, :] * sk_k + d_index[:, None], mask=inside[None, :], other=0.0)
        scores = tl.dot(query, keys) * scale  # [QUERIES, BLOCK], float32
        seen = inside[None, :] & (k_index[None, :] <= last[:, None])
        scores = tl.where(seen, scores, float("-inf"))
        new_maximum = tl.maximum(maximum, tl.max(scores, 1))
        shift = tl.where(new_maximum == float("-inf"), 0.0, new_maximum)  # a query that has seen no key yet
        weights = tl.exp(scores - shift[:, None])
        rescale = tl.exp(maximum - shift)
        values = tl.load(v_base + k_index[:, None] * sv_k + d_index[None, :], mask=inside[:, None], other=0.0)
        acc = acc * rescale[:, None] + tl.dot(weights.to(values.dtype), values)
        total = total * rescale + tl.sum(weights, 1)
        maximum = new_maximum

    if SPLIT:  # [row * heads + head, split, query]: queries padded to whole blocks
        at = (row_head.to(tl.int64) * tl.num_programs(1) + split) * (tl.num_programs(2) * QUERIES) + q_index
        tl.store(PARTIAL + at[:, None] * HEAD_DIM + d_index[None, :], acc)
        tl.store(MAXIMA + at, maximum)
        tl.store(SUMS + at, total)
    else:
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(OUT + row * so_n + head * so_h + q_index[:, None] * so_q + d_index[None, :],
                 out.to(OUT.dtype.element_ty), mask=live[:, None])


@triton.jit
def combine(PARTIAL, MAXIMA, SUMS, OUT, so_n, so_q, so_h, heads, queries,
            SPLITS: tl.constexpr, QUERIES: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A row's head, QUERIES of its queries: the splits' partial softmaxes as one (program ids:
    row * heads + head, block of queries)."""
    row_head = tl.program_id(0)
    block = tl.program_id(1)
    row = (row_head // heads).to(tl.int64)
    head = row_head % heads
    s_index = tl.arange(0, SPLITS)
    q_index = block * QUERIES + tl.arange(0, QUERIES)
    d_index = tl.arange(0, HEAD_DIM)
    padded = tl.num_programs(1) * QUERIES
    at = (row_head.to(tl.int64) * SPLITS + s_index[:, None]) * padded + q_index[None, :]  # [SPLITS, QUERIES]
    maxima = tl.load(MAXIMA + at)
    sums = tl.load(SUMS + at)
    maximum = tl.max(maxima, 0)  # [QUERIES]
    shift = tl.where(maximum == float("-inf"), 0.0, maximum)
    weights = tl.exp(maxima - shift[None, :])  # a split that saw no key: exp(-inf) = 0
    total = tl.sum(weights * sums, 0)
    partial = tl.load(PARTIAL + at[:, :, None] * HEAD_DIM + d_index[None, None, :])  # [SPLITS, QUERIES, HEAD_DIM]
    out = tl.sum(partial * weights[:, :, None], 0) / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(OUT + row * so_n + head * so_h + q_index[:, None] * so_q + d_index[None, :],
             out.to(OUT.dtype.element_ty), mask=(q_index < queries)[:, None])
