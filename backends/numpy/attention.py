"""Runtime helpers for programs that read the sequence: visibility masks, masked softmax, and Reformer's
LSH attention (the bucketed form and its dense reference). Arrays are [B, T, H, *]."""
from __future__ import annotations

import math

import numpy as np


def visible_positions(tokens: int, causal: bool, window: int, start: int = 0, stop: int | None = None,
                      key_start: int = 0, key_stop: int | None = None):
    """Which keys each query sees, shaped [1, queries, 1, keys] to broadcast against [B, T, H, T]; None
    when every query sees every key."""
    stop = tokens if stop is None else stop
    key_stop = tokens if key_stop is None else key_stop
    if not causal and not window:
        return None
    i = np.arange(start, stop)[:, None]
    j = np.arange(key_start, key_stop)[None, :]
    seen = np.ones((stop - start, key_stop - key_start), dtype=bool)
    if causal:
        seen &= j <= i
    if window:
        seen &= (i - j < window) & (j - i < window)
    return seen[None, :, None, :]


def mask(x, visible):
    """Zero what a query does not see (before a sum or a contraction over the sequence)."""
    return x if visible is None else np.where(visible, x, 0.0)


def masked_mean(x, visible):
    """The mean over the keys a query sees: their sum over their count (np.mean of the masked row would divide
    by every key, the unseen ones too)."""
    if visible is None:
        return np.mean(x, axis=-1)
    return np.sum(np.where(visible, x, 0.0), axis=-1) / np.sum(visible, axis=-1)


def masked_rmsnorm(x, visible, eps=1e-6):
    """rmsnorm over the keys a query sees (runtime.rmsnorm's, its mean of squares over those keys); the unseen
    keys' entries are 0, as mask gives them."""
    seen = mask(x, visible)
    return seen / np.sqrt(masked_mean(seen * seen, visible)[..., None] + eps)


def masked_groupnorm(x, visible, eps=1e-5):
    """groupnorm over the keys a query sees (runtime.groupnorm's: zero mean and unit variance over them); the
    unseen keys' entries are 0, as mask gives them."""
    centered = mask(x - masked_mean(x, visible)[..., None], visible)
    return centered / np.sqrt(masked_mean(centered * centered, visible)[..., None] + eps)


def softmax(x):
    shifted = x - np.max(x, axis=-1, keepdims=True)
    e = np.exp(shifted)
    return e / np.sum(e, axis=-1, keepdims=True)


def masked_softmax(x, visible):
    """softmax over the visible keys only (every query sees at least itself)."""
    if visible is None:
        return softmax(x)
    x = np.where(visible, x, -np.inf)
    e = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)


def online_softmax_step(m, l, acc, scores, values):
    """Fold one key block into a running (max m, denominator l, accumulator acc): flash attention.
    scores [..., keys] (−inf where not visible); values [..., keys, dv]."""
    block_max = np.max(scores, axis=-1)
    m_new = np.maximum(m, block_max)
    safe = np.where(np.isfinite(m_new), m_new, 0.0)  # rows that have seen no key yet
    p = np.exp(scores - safe[..., None])
    rescale = np.exp(m - safe)
    l = l * rescale + np.sum(p, axis=-1)
    acc = acc * rescale[..., None] + np.einsum("...j,...jd->...d", p, values)
    return m_new, l, acc


# ---- Reformer ---------------------------------------------------------------------------------
def _rotations(dk: int, buckets: int, rounds: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rounds, dk, buckets // 2))


def lsh_buckets(q, buckets: int, rounds: int, seed: int) -> np.ndarray:
    """h(x) = argmax([xR; −xR]) for each round: [rounds, B, T, H]."""
    r = _rotations(q.shape[-1], buckets, rounds, seed).astype(q.dtype)
    projected = np.einsum("bthd,rdn->rbthn", q, r)
    return np.argmax(np.concatenate([projected, -projected], axis=-1), axis=-1)


def _round_order(bucket_of, tokens: int):
    """Sort tokens by (bucket, position) per (b, h): order [B, H, T] of positions."""
    b = np.moveaxis(bucket_of, 1, -1)  # [B, H, T]
    key = b * tokens + np.arange(tokens)
    return np.argsort(key, axis=-1, kind="stable")


def _scores(q, keys):
    return np.einsum("...id,...jd->...ij", q, keys) / math.sqrt(q.shape[-1])


def _finish_round(scores, allowed, values):
    """Softmax over the allowed keys, a token attending to itself only when it sees nothing else;
    returns (output, log-sum-exp)."""
    x = np.where(allowed, scores, -np.inf)
    m = np.max(x, axis=-1, keepdims=True)
    e = np.exp(x - m)
    total = np.sum(e, axis=-1, keepdims=True)
    return np.einsum("...ij,...jd->...id", e / total, values), (m + np.log(total))[..., 0]


def _round_weights(lse):
    """Each round's weight exp(lse_r − logsumexp_r lse_r), [R, …], from the rounds' log-sum-exps."""
    lse = np.stack(lse)
    w = np.exp(lse - np.max(lse, axis=0))
    return w / np.sum(w, axis=0)


def _combine(outputs, lse):
    """Rounds weighted by exp(lse_r − logsumexp_r lse_r)."""
    return np.sum(_round_weights(lse)[..., None] * np.stack(outputs), axis=0)


def _probabilities(x):
    """(P, lse) of scores x with −∞ where a key is not seen: lse = log Σ exp(x) over the last axis (kept), and
    P = exp(x − lse), the backward's probabilities recomputed from it."""
    top = np.max(x, axis=-1, keepdims=True)
    lse = top + np.log(np.sum(np.exp(x - top), axis=-1, keepdims=True))
    return np.exp(x - lse), lse


def _into_queries(d_q, d_keys, keys, norm):
    """∂q with the shared keys' adjoint added: k = q/‖q‖ gives ∂q += (∂k − k (k·∂k))/‖q‖ (all [B, H, T, *])."""
    return d_q + (d_keys - keys * np.sum(keys * d_keys, axis=-1, keepdims=True)) / norm


def _self_rule(allowed, is_self):
    """Exclude self unless a query has no other key."""
    others = allowed & ~is_self
    return np.where(np.any(others, axis=-1, keepdims=True), others, allowed & is_self)


def _lsh_masks(q, causal: bool, buckets: int, rounds: int, chunk: int, seed: int):
    """Per round, which keys each query attends to [B, H, T, T]: same bucket and within the chunk window of
    the sorted order (the bucketed form's exact mask), causal where asked, itself only when nothing else."""
    batch, tokens, heads, _ = q.shape
    for bucket_of in lsh_buckets(q, buckets, rounds, seed):
        order = _round_order(bucket_of, tokens)
        rank = np.empty_like(order)
        np.put_along_axis(rank, order, np.arange(tokens)[None, None, :].repeat(batch, 0).repeat(heads, 1), -1)
        chunk_of = rank // chunk                                     # [B, H, T]
        b = np.moveaxis(bucket_of, 1, -1)
        allowed = (b[..., :, None] == b[..., None, :])
        diff = chunk_of[..., :, None] - chunk_of[..., None, :]
        allowed &= (diff == 0) | (diff == 1)
        pos = np.arange(tokens)
        if causal:
            allowed &= pos[None, :] <= pos[:, None]
        yield _self_rule(allowed, np.eye(tokens, dtype=bool))


def _shared_keys(q):
    """Reformer's shared-QK keys q/‖q‖, and the norm (with its 1e-12 inside the root)."""
    norm = np.sqrt(np.sum(q * q, axis=-1, keepdims=True) + 1e-12)
    return q / norm, norm


def lsh_attention_dense(q, v, causal: bool, buckets: int, rounds: int, chunk: int, seed: int):
    """The dense reference: full softmax attention masked to 'same bucket and within the chunk window of
    the sorted order' per round (the bucketed form's exact mask), rounds combined by log-sum-exp."""
    qh, kh, vh = (np.swapaxes(x, 1, 2) for x in (q, _shared_keys(q)[0], v))  # [B, H, T, *]
    scores = _scores(qh, kh)
    outs, lses = [], []
    for allowed in _lsh_masks(q, causal, buckets, rounds, chunk, seed):
        o, lse = _finish_round(scores, allowed, vh)
        outs.append(o)
        lses.append(lse)
    return np.swapaxes(_combine(outs, lses), 1, 2)


def lsh_attention_backward(q, v, d_out, causal: bool, buckets: int, rounds: int, chunk: int, seed: int):
    """(∂q, ∂v) of lsh_attention_dense with the buckets held fixed: the hash (an argmax of q's projections) is
    piecewise constant in q, so away from the measure-zero set where a bucket changes the gradient is that of
    attention within the fixed masks. Per round r, P_r = softmax of the masked scores, o_r = P_r·V and lse_r;
    o = Σ_r w_r o_r with w = softmax over the rounds of lse_r. Then ∂w_r = ∂o·o_r, ∂lse_r = w_r(∂w_r − Σ w ∂w),
    ∂S = Σ_r P_r ⊙ (∂P_r − rowsum(P_r ⊙ ∂P_r) + ∂lse_r) with ∂P_r = w_r ∂o·Vᵀ, ∂V = Σ_r Pᵣᵀ (w_r ∂o); the scores
    S = q·kᵀ/√dk with the keys k = q/‖q‖ give ∂q = ∂S·k/√dk + (∂k − k (k·∂k))/‖q‖, ∂k = ∂Sᵀ·q/√dk."""
    keys, norm = _shared_keys(q)
    qh, kh, vh, gh, nh = (np.swapaxes(x, 1, 2) for x in (q, keys, v, d_out, norm))
    scores = _scores(qh, kh)
    probs, outs, lses = [], [], []
    for allowed in _lsh_masks(q, causal, buckets, rounds, chunk, seed):
        p, lse = _probabilities(np.where(allowed, scores, -np.inf))
        probs.append(p)
        outs.append(p @ vh)
        lses.append(lse[..., 0])
    w = _round_weights(lses)
    d_w = np.stack([np.sum(gh * o, axis=-1) for o in outs])
    d_lse = w * (d_w - np.sum(w * d_w, axis=0))
    d_scores, d_v = np.zeros_like(scores), np.zeros_like(vh)
    for p, weight, d_l in zip(probs, w, d_lse):
        d_o = weight[..., None] * gh
        d_v += np.swapaxes(p, -1, -2) @ d_o
        d_p = d_o @ np.swapaxes(vh, -1, -2)
        d_scores += p * (d_p - np.sum(p * d_p, axis=-1, keepdims=True) + d_l[..., None])
    scale = 1.0 / math.sqrt(q.shape[-1])
    d_keys = np.swapaxes(d_scores, -1, -2) @ qh * scale
    d_q = _into_queries(d_scores @ kh * scale, d_keys, kh, nh)
    return np.swapaxes(d_q, 1, 2), np.swapaxes(d_v, 1, 2)


def _gather(x, positions):
    """Rows of x [B, H, T, d] at positions [B, H, …] (−1 for padding reads row 0, masked later)."""
    batch, heads = x.shape[:2]
    flat = np.maximum(positions, 0).reshape(batch, heads, -1)[..., None]
    return np.take_along_axis(x, flat, axis=2).reshape(positions.shape + (x.shape[-1],))


def _round_blocks(bucket_of, causal: bool, chunk: int):
    """One round's blocks of the bucketed form, from its buckets [B, T, H]: (idx [B, H, n, c] the positions of
    each chunk's queries in the round's sorted order, −1 for padding; look [B, H, n, 2c] their candidate keys,
    the chunk and the previous one; allowed [B, H, n, c, 2c] the keys each query sees — same bucket, causal,
    itself only when nothing else; real [B, H, n, c, 1] the rows that are queries, not padding)."""
    batch, tokens, heads = bucket_of.shape
    padded = -(-tokens // chunk) * chunk
    order = _round_order(bucket_of, tokens)                          # [B, H, T]
    pad = np.concatenate([order, np.full(order.shape[:-1] + (padded - tokens,), -1)], axis=-1)
    idx = pad.reshape(batch, heads, padded // chunk, chunk)
    prev = np.concatenate([np.full_like(idx[:, :, :1], -1), idx[:, :, :-1]], axis=2)
    look = np.concatenate([idx, prev], axis=-1)
    b = np.moveaxis(bucket_of, 1, -1)
    bq = np.take_along_axis(b, np.maximum(idx, 0).reshape(batch, heads, -1), -1).reshape(idx.shape)
    bk = np.take_along_axis(b, np.maximum(look, 0).reshape(batch, heads, -1), -1).reshape(look.shape)
    allowed = (look[..., None, :] >= 0) & (bq[..., :, None] == bk[..., None, :])
    if causal:
        allowed &= look[..., None, :] <= idx[..., :, None]
    allowed = _self_rule(allowed, look[..., None, :] == idx[..., :, None])
    return idx, look, allowed, (idx >= 0)[..., :, None]


def lsh_attention_bucketed(q, v, causal: bool, buckets: int, rounds: int, chunk: int, seed: int):
    """The O(T log T) form: sort by (bucket, position), cut into chunks, attend within the chunk and the
    previous one (same bucket, causal, self only when nothing else), rounds combined by log-sum-exp."""
    batch, tokens, heads, dk = q.shape
    keys = q / np.sqrt(np.sum(q * q, axis=-1, keepdims=True) + 1e-12)
    qh, kh, vh = (np.swapaxes(x, 1, 2) for x in (q, keys, v))
    outs, lses = [], []
    for bucket_of in lsh_buckets(q, buckets, rounds, seed):
        idx, look, allowed, real = _round_blocks(bucket_of, causal, chunk)
        qc, kc, vc = _gather(qh, idx), _gather(kh, look), _gather(vh, look)
        o, lse = _finish_round(_scores(qc, kc), allowed | ~real, vc)
        # scatter back from sorted chunks to positions
        out = np.zeros((batch, heads, tokens, v.shape[-1]), dtype=o.dtype)
        out_lse = np.zeros((batch, heads, tokens), dtype=lse.dtype)
        flat_idx, flat_o, flat_l = idx.reshape(batch, heads, -1), o.reshape(batch, heads, -1, o.shape[-1]), \
            lse.reshape(batch, heads, -1)
        keep = flat_idx >= 0
        for bb in range(batch):
            for hh in range(heads):
                pos = flat_idx[bb, hh][keep[bb, hh]]
                out[bb, hh, pos] = flat_o[bb, hh][keep[bb, hh]]
                out_lse[bb, hh, pos] = flat_l[bb, hh][keep[bb, hh]]
        outs.append(out)
        lses.append(out_lse)
    return np.swapaxes(_combine(outs, lses), 1, 2)


def _bucketed_blocks(q, keys, bucket_of, causal: bool, chunk: int):
    """One round of the bucketed form by blocks: (idx [B, H, n, c] the positions of each chunk's queries, −1
    for padding; look [B, H, n, 2c] their candidate keys, the chunk and the previous one; P [B, H, n, c, 2c] each
    query's probabilities over them (0 where not allowed and on padding rows); lse [B, H, n, c])."""
    qh, kh = (np.swapaxes(x, 1, 2) for x in (q, keys))
    idx, look, allowed, real = _round_blocks(bucket_of, causal, chunk)
    p, lse = _probabilities(np.where(allowed | ~real, _scores(_gather(qh, idx), _gather(kh, look)), -np.inf))
    return idx, look, np.where(real, p, 0.0), lse[..., 0]


def _scatter_add(target, positions, values):
    """target [B, H, T, d] (C-contiguous) += values [B, H, …, d] at positions [B, H, …] (−1: none)."""
    batch, heads, tokens, width = target.shape
    flat = positions.reshape(batch, heads, -1)
    rows = (np.arange(batch)[:, None, None] * heads + np.arange(heads)[None, :, None]) * tokens + np.maximum(flat, 0)
    vals = np.where((flat >= 0)[..., None], values.reshape(batch, heads, -1, width), 0.0)
    np.add.at(target.reshape(-1, width), rows.reshape(-1), vals.reshape(-1, width))


def lsh_attention_bucketed_backward(q, v, d_out, causal: bool, buckets: int, rounds: int, chunk: int, seed: int):
    """(∂q, ∂v) of lsh_attention_bucketed with the buckets held fixed, by its blocks (each round's chunks
    against the chunk and the previous one of the sorted order: O(T·chunk) per round, no [T, T] matrix). The
    forward's blocks are recomputed, each round's P_r and lse_r, with ∂P_r = ∂o·Vᵀ over the same blocks; the
    rounds' weights w = softmax_r(lse_r) make the combined weights P̄ = w_r P_r an attention matrix, and
    ∂S = P̄ ⊙ (∂P − rowsum(P̄ ⊙ ∂P)) (the rounds' ∂P − rowsum(P_r ⊙ ∂P) and their ∂lse_r add up to it; the row
    sums over the same ∂P, so that a query alone with itself has ∂S = 0 exactly), ∂V = P̄ᵀ·∂o; then through the
    scores q·kᵀ/√dk and the shared keys k = q/‖q‖ into ∂q, as lsh_attention_backward."""
    batch, tokens, heads, dk = q.shape
    keys, norm = _shared_keys(q)
    qh, kh, vh, gh, nh = (np.swapaxes(x, 1, 2) for x in (q, keys, v, d_out, norm))
    blocks, lses = [], []
    for bucket_of in lsh_buckets(q, buckets, rounds, seed):
        idx, look, p, lse = _bucketed_blocks(q, keys, bucket_of, causal, chunk)
        at = np.zeros((batch, heads, tokens, 1), dtype=lse.dtype)
        _scatter_add(at, idx, lse[..., None])
        blocks.append((idx, look, p, _gather(gh, idx) @ np.swapaxes(_gather(vh, look), -1, -2)))  # ∂P_r
        lses.append(at[..., 0])
    w = _round_weights(lses)                                          # [R, B, H, T]
    p_bars = [_gather(weight[..., None], idx) * p for weight, (idx, _, p, _) in zip(w, blocks)]
    rowsum = np.zeros((batch, heads, tokens, 1), dtype=w.dtype)       # Σ_r Σ_j P̄ ∂P per position
    for p_bar, (idx, _, _, d_p) in zip(p_bars, blocks):
        _scatter_add(rowsum, idx, np.sum(p_bar * d_p, axis=-1, keepdims=True))
    scale = 1.0 / math.sqrt(dk)
    d_q, d_keys, d_v = (np.zeros(x.shape, x.dtype) for x in (qh, kh, vh))  # (C order: _scatter_add's reshape)
    for p_bar, (idx, look, _, d_p) in zip(p_bars, blocks):
        d_s = p_bar * (d_p - _gather(rowsum, idx)) * scale             # (padding rows: p̄ is 0)
        _scatter_add(d_q, idx, d_s @ _gather(kh, look))
        _scatter_add(d_keys, look, np.swapaxes(d_s, -1, -2) @ _gather(qh, idx))
        _scatter_add(d_v, look, np.swapaxes(p_bar, -1, -2) @ _gather(gh, idx))
    d_q = _into_queries(d_q, d_keys, kh, nh)
    return np.swapaxes(d_q, 1, 2), np.swapaxes(d_v, 1, 2)


def attention(queries, keys, values, causal: bool, window: int, form: str = "parallel", chunk_size=None):
    """softmax(queries·keysᵀ over the visible keys)·values: [B, Tq, H, d], [B, Tk, H, d], [B, Tk, H, dv].
    The NumPy twin of linrec.c.attention.attention (every form computes the same dense result here)."""
    scores = np.einsum("bthd,bshd->bths", queries, keys)
    visible = visible_positions(queries.shape[1], causal, window, 0, queries.shape[1], 0, keys.shape[1]) \
        if (causal or window) else None
    return np.einsum("bths,bshd->bthd", masked_softmax(scores, visible), values)


# ---- flash attention with its statistics, and its backward (docs/gradients.md) ------------------------
def _key_range(start: int, stop: int, tokens: int, causal: bool, window: int) -> range:
    """The key positions a query block [start, stop) can see, as the chunkwise forward (sequence.py) takes them."""
    first = max(0, start - (window - 1)) if window else 0
    last = stop if causal else (min(tokens, stop + window - 1) if window else tokens)
    return range(first, last)


def _block_scores(q, k, tokens, causal, window, queries: slice, keys: slice):
    """The scores k·q of a query block against a key block [B, Tq, H, Tk], −∞ where a query does not see a key."""
    scores = np.einsum("bqhd,bkhd->bqhk", q[:, queries], k[:, keys])
    visible = visible_positions(tokens, causal, window, queries.start, queries.stop, keys.start, keys.stop)
    return scores if visible is None else np.where(visible, scores, -np.inf)


def flash_attention(q, k, v, causal: bool, window: int, block: int):
    """softmax(K·q_t)·V over the keys each query sees, query blocks against key blocks with an online softmax:
    (outputs [B, T, H, dv], the log-sum-exp of each query's scores [B, T, H]: what the backward needs to
    recompute any block's probabilities). q, k [B, T, H, dk]; v [B, T, H, dv]."""
    batch, tokens, heads = q.shape[:3]
    dtype = np.result_type(q, k, v)
    out = np.empty((batch, tokens, heads, v.shape[-1]), dtype)
    lse = np.empty((batch, tokens, heads), dtype)
    for start in range(0, tokens, block):
        queries = slice(start, min(start + block, tokens))
        n = queries.stop - start
        m, l = np.full((batch, n, heads), -np.inf, dtype), np.zeros((batch, n, heads), dtype)
        acc = np.zeros((batch, n, heads, v.shape[-1]), dtype)
        span = _key_range(start, queries.stop, tokens, causal, window)
        for key_start in range(span.start, span.stop, block):
            keys = slice(key_start, min(key_start + block, span.stop))
            scores = _block_scores(q, k, tokens, causal, window, queries, keys)
            m, l, acc = online_softmax_step(m, l, acc, scores, np.swapaxes(v[:, keys], 1, 2)[:, None])
        out[:, queries] = acc / l[..., None]
        lse[:, queries] = m + np.log(l)
    return out, lse


def flash_attention_backward(q, k, v, out, lse, d_out, causal: bool, window: int, block: int):
    """The backward of flash_attention: (∂q, ∂k, ∂v). Per query block and key block, the probabilities are
    recomputed from the scores and the log-sum-exp, P = exp(S − lse); with D = rowsum(∂O ⊙ O) (= Σ_j P_j ∂P_j
    over every key a query sees), ∂S = P ⊙ (∂P − D), ∂P = ∂O·Vᵀ: then ∂q = ∂S·K, ∂k = ∂Sᵀ·Q, ∂v = Pᵀ·∂O, each a
    sum over blocks. Memory: one block of scores [B, C, H, C]."""
    tokens = q.shape[1]
    dtype = np.result_type(q, k, v, d_out)
    d_q, d_k, d_v = np.zeros(q.shape, dtype), np.zeros(k.shape, dtype), np.zeros(v.shape, dtype)
    rowsum = np.einsum("bthd,bthd->bth", d_out, out)
    for start in range(0, tokens, block):
        queries = slice(start, min(start + block, tokens))
        span = _key_range(start, queries.stop, tokens, causal, window)
        stats, rows, grads = lse[:, queries, :, None], rowsum[:, queries, :, None], d_out[:, queries]
        for key_start in range(span.start, span.stop, block):
            keys = slice(key_start, min(key_start + block, span.stop))
            p = np.exp(_block_scores(q, k, tokens, causal, window, queries, keys) - stats)  # (0 where not seen)
            d_v[:, keys] += np.einsum("bqhk,bqhd->bkhd", p, grads)
            d_scores = p * (np.einsum("bqhd,bkhd->bqhk", grads, v[:, keys]) - rows)
            d_q[:, queries] += np.einsum("bqhk,bkhd->bqhd", d_scores, k[:, keys])
            d_k[:, keys] += np.einsum("bqhk,bqhd->bkhd", d_scores, q[:, queries])
    return d_q, d_k, d_v
