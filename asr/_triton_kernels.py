"""The Triton kernels of asr/triton_ops.py (imported only where Triton runs)."""

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


@triton.jit
def linear(X, W, BIAS, NORM_W, NORM_B, RESIDUAL, Y, CACHE, CACHE_ROWS, CACHE_POSITIONS,
           rows, cols, depth, sx, sw, sr, sy, eps, kept, head_dim, cache_batch, capacity,
           sc_part, sc_row, sc_head, sc_position,
           HAS_BIAS: tl.constexpr, NORM: tl.constexpr, GELU: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
           TO_CACHE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Y = f(X) @ W.T (+ BIAS) (then GELU) (+ RESIDUAL) for BLOCK_M rows and BLOCK_N columns
    (program ids: block of rows, block of columns), accumulated in float32 over blocks of
    BLOCK_K; f: the layer norm of each row (NORM, its statistics in float32, the normalised
    row rounded to W's dtype as a norm's output would be) or nothing. A row's result depends
    on its own values only, not on how many rows the call has. TO_CACHE: Y takes the first
    `kept` columns (a query), the next `kept` and the last `kept` (keys, values; heads of
    head_dim) go into CACHE [2, B, H, C, head_dim] (its strides sc_*) at each row's cache row
    and position (CACHE_ROWS, CACHE_POSITIONS); a row or position outside the cache (cache_batch
    rows, capacity positions) is not written, where it would land in another row's or layer's."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    m_in = m < rows
    n_in = n < cols
    x_rows = X + m.to(tl.int64)[:, None] * sx
    if NORM:  # the mean, then the squares about it (the sum of squares less the mean's cancels)
        # Loads pipelined (a plain range waited for each block's before the next: ~20 round trips
        # before the first product); the sums keep their order.
        total = tl.zeros([BLOCK_M], tl.float32)
        for start in tl.range(0, depth, BLOCK_K, num_stages=3):
            x = tl.load(x_rows + (start + k)[None, :], mask=m_in[:, None] & (start + k < depth)[None, :],
                        other=0.0).to(tl.float32)
            total += tl.sum(x, 1)
        mean = total / depth
        squares = tl.zeros([BLOCK_M], tl.float32)
        for start in tl.range(0, depth, BLOCK_K, num_stages=3):
            inside = m_in[:, None] & (start + k < depth)[None, :]
            x = tl.load(x_rows + (start + k)[None, :], mask=inside, other=0.0).to(tl.float32)
            centred = tl.where(inside, x - mean[:, None], 0.0)
            squares += tl.sum(centred * centred, 1)
        rstd = tl.rsqrt(squares / depth + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_cols = W + n.to(tl.int64)[None, :] * sw
    for start in range(0, depth, BLOCK_K):
        kk = start + k
        k_in = kk < depth
        x = tl.load(x_rows + kk[None, :], mask=m_in[:, None] & k_in[None, :], other=0.0)
        if NORM:
            gain = tl.load(NORM_W + kk, mask=k_in, other=0.0).to(tl.float32)
            shift = tl.load(NORM_B + kk, mask=k_in, other=0.0).to(tl.float32)
            x = ((x.to(tl.float32) - mean[:, None]) * rstd[:, None] * gain[None, :] + shift[None, :])
            x = x.to(W.dtype.element_ty)
        w = tl.load(w_cols + kk[:, None], mask=k_in[:, None] & n_in[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        acc += tl.load(BIAS + n, mask=n_in, other=0.0).to(tl.float32)[None, :]
    if GELU:  # the exact GELU, as Whisper's
        acc = 0.5 * acc * (1.0 + tl.erf(acc * 0.7071067811865476))
    out = m_in[:, None] & n_in[None, :]
    if HAS_RESIDUAL:
        acc += tl.load(RESIDUAL + m.to(tl.int64)[:, None] * sr + n[None, :], mask=out, other=0.0).to(tl.float32)
    if TO_CACHE:
        into = tl.maximum(n - kept, 0)  # a key's or value's column (masked below for the query's)
        row = tl.load(CACHE_ROWS + m, mask=m_in, other=0).to(tl.int64)
        position = tl.load(CACHE_POSITIONS + m, mask=m_in, other=0).to(tl.int64)
        at = ((into // kept) * sc_part + ((into % kept) // head_dim) * sc_head + into % head_dim)[None, :] \
            + (row * sc_row + position * sc_position)[:, None]
        inside = (row >= 0) & (row < cache_batch) & (position >= 0) & (position < capacity)
        tl.store(CACHE + at, acc.to(CACHE.dtype.element_ty), mask=out & inside[:, None] & (n >= kept)[None, :])
        out = out & (n < kept)[None, :]
    tl.store(Y + m.to(tl.int64)[:, None] * sy + n[None, :], acc.to(Y.dtype.element_ty), mask=out)
