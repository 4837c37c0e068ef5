"""Triton source of ``qk_rope.qk_norm_rope`` (imported only when the kernel is first built,
so that machines without Triton never import it)."""
import triton
import triton.language as tl


@triton.jit
def norm_rotate(src, w_ptr, b_ptr, eps, cos, sin, m2, d, dp, D: tl.constexpr):
    """LayerNorm (float32) of one head's rows at ``src`` and their RoPE rotation."""
    x = tl.load(src + d[None, :], mask=m2, other=0.0).to(tl.float32)
    xp = tl.load(src + dp[None, :], mask=m2, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / D
    xc = x - mean[:, None]
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / D + eps)
    w = tl.load(w_ptr + d).to(tl.float32)
    b = tl.load(b_ptr + d).to(tl.float32)
    wp = tl.load(w_ptr + dp).to(tl.float32)
    bp = tl.load(b_ptr + dp).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :] + b[None, :]
    yp = (xp - mean[:, None]) * rstd[:, None] * wp[None, :] + bp[None, :]
    return y * cos + yp * sin


@triton.jit
def qk_norm_rope_kernel(qkv_ptr, qkv_stride, qw_ptr, qb_ptr, kw_ptr, kb_ptr, cos_ptr, sin_ptr, table_rows,
                        slots_ptr, q_ptr, k_ptr, v_ptr, n_tokens, q_reps, q_rep_stride, q_eps, k_eps,
                        H: tl.constexpr, D: tl.constexpr, XOR: tl.constexpr, BLOCK_N: tl.constexpr,
                        HAS_SLOTS: tl.constexpr, STORE_V: tl.constexpr):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = rows < n_tokens
    m2 = valid[:, None]
    d = tl.arange(0, D)
    dp = d ^ XOR
    src = qkv_ptr + rows[:, None].to(tl.int64) * qkv_stride + h * D
    trow = (rows % table_rows).to(tl.int64)
    cos = tl.load(cos_ptr + trow[:, None] * D + d[None, :], mask=m2, other=0.0)
    sin = tl.load(sin_ptr + trow[:, None] * D + d[None, :], mask=m2, other=0.0)
    if HAS_SLOTS:
        dest = tl.load(slots_ptr + rows, mask=valid, other=0).to(tl.int64)
    else:
        dest = rows.to(tl.int64)
    dest_off = dest[:, None] * (H * D) + h * D + d[None, :]

    # q: q_reps copies at the token's row; k (and v) at the destination rows
    q = norm_rotate(src, qw_ptr, qb_ptr, q_eps, cos, sin, m2, d, dp, D).to(q_ptr.dtype.element_ty)
    q_off = rows[:, None].to(tl.int64) * (H * D) + h * D + d[None, :]
    for r in range(q_reps):
        tl.store(q_ptr + r * q_rep_stride + q_off, q, mask=m2)
    k = norm_rotate(src + H * D, kw_ptr, kb_ptr, k_eps, cos, sin, m2, d, dp, D)
    tl.store(k_ptr + dest_off, k.to(k_ptr.dtype.element_ty), mask=m2)
    if STORE_V:
        v = tl.load(src + 2 * H * D + d[None, :], mask=m2, other=0.0)
        tl.store(v_ptr + dest_off, v.to(v_ptr.dtype.element_ty), mask=m2)
