"""Gated DeltaNet's two sequence ops over a step's requests, each request carrying its state in a slot:

    causal_conv1d      out_t = silu(sum_j w[:, j] * y[t + j])   y = the slot's last K-1 inputs ++ this step's
    gated_delta_rule   S = S * exp(g_t);  S += k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T (q_t * scale)
                       (q_t, k_t L2-normalized first; S is [Dk, Dv] per value head)

A step's tokens are "varlen": request r owns rows query_start_loc[r] .. query_start_loc[r + 1] - 1 and the
state slot state_idx[r]; a segment is a whole prompt, a chunk of one (its state carries to the next step), a
decode token. States are float32 whatever the model's dtype, updated in place.

These are the torch forms (the reference the C++ kernels are tested against, and the path where no compiler
is): decode rows batched in one recurrent step, longer segments one by one in the chunked form (chunks of 64
tokens: within a chunk the delta rule's updates are one unit lower-triangular solve, a WY representation, and
the state is read and written once per chunk).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dim (the normalization Qwen3.5's DeltaNet applies to q and k)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, state_idx: torch.Tensor,
                  query_start_loc: list[int]) -> torch.Tensor:
    """x [T, C], weight [C, K] float32, conv_state [S, C, K - 1] float32 (in place) -> silu(conv) [T, C]."""
    K = weight.shape[1]
    xf = x.float()
    out = torch.empty_like(xf)
    lens = [b - a for a, b in zip(query_start_loc[:-1], query_start_loc[1:])]
    if all(n == 1 for n in lens):  # all decodes: one batched window per request
        window = torch.cat((conv_state[state_idx], xf[:, :, None]), dim=2)  # [R, C, K]
        conv_state[state_idx] = window[:, :, 1:]
        return F.silu((window * weight).sum(-1)).to(x.dtype)
    for r, n in enumerate(lens):
        if n == 0:
            continue
        a, slot = query_start_loc[r], int(state_idx[r])
        y = torch.cat((conv_state[slot], xf[a:a + n].T), dim=1)  # [C, K - 1 + n]
        out[a:a + n] = F.conv1d(y[None], weight[:, None, :], groups=weight.shape[0])[0].T
        conv_state[slot] = y[:, y.shape[1] - (K - 1):]
    return F.silu(out).to(x.dtype)


def _recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of many sequences: q, k [N, H, Dk], v [N, H, Dv], g, beta [N, H], state [N, H, Dk, Dv]."""
    state = state * g.exp()[..., None, None]
    kv = torch.einsum("nhkv,nhk->nhv", state, k)
    delta = (v - kv) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return torch.einsum("nhkv,nhk->nhv", state, q), state


def _chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q, k [H, L, Dk], v [H, L, Dv], g, beta [H, L], state [H, Dk, Dv] -> ([H, L, Dv], state)."""
    H, L, _ = q.shape
    pad = (-L) % CHUNK
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (L + pad) // CHUNK
    q, k, v = (t.reshape(H, n, CHUNK, -1) for t in (q, k, v))
    g, beta = g.reshape(H, n, CHUNK).cumsum(-1), beta.reshape(H, n, CHUNK)
    decay = (g[..., :, None] - g[..., None, :])  # [H, n, i, j]: log decay from token j to token i
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool).tril()
    decay = decay.masked_fill(~lower, float("-inf")).exp()
    k_beta = k * beta[..., None]
    # (I + strictly lower(beta_i k_i . k_j decay_ij)) solves every update of the chunk at once
    system = (k_beta @ k.transpose(-1, -2) * decay).tril(-1) + torch.eye(CHUNK)
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * g.exp()[..., None], upper=False, unitriangular=True)
    scores = q @ k.transpose(-1, -2) * decay
    q_decayed = q * g.exp()[..., None]
    k_to_end = k * (g[..., -1:] - g).exp()[..., None]
    out = torch.empty_like(v)
    for c in range(n):
        v_new = u[:, c] - w[:, c] @ state
        out[:, c] = q_decayed[:, c] @ state + scores[:, c] @ v_new
        state = state * g[:, c, -1].exp()[:, None, None] + k_to_end[:, c].transpose(-1, -2) @ v_new
    return out.reshape(H, n * CHUNK, -1)[:, :L], state


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, state_idx: torch.Tensor, query_start_loc: list[int], scale: float,
                     use_qk_l2norm: bool = True) -> torch.Tensor:
    """q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv] float32, state [S, Hv, Dk, Dv] float32 (in place)
    -> [T, Hv, Dv] float32. Value head h reads q/k head h // (Hv / Hk)."""
    Hk, Hv = q.shape[1], v.shape[1]
    q, k, v = q.float(), k.float(), v.float()
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * scale
    if Hv != Hk:
        q, k = q.repeat_interleave(Hv // Hk, dim=1), k.repeat_interleave(Hv // Hk, dim=1)
    lens = [b - a for a, b in zip(query_start_loc[:-1], query_start_loc[1:])]
    if all(n == 1 for n in lens):  # all decodes: one batched recurrent step
        out, state[state_idx] = _recurrent(q, k, v, g, beta, state[state_idx])
        return out
    out = torch.empty_like(v)
    for r, n in enumerate(lens):
        if n == 0:
            continue
        a, slot = query_start_loc[r], int(state_idx[r])
        if n == 1:
            o, s = _recurrent(q[a:a + 1], k[a:a + 1], v[a:a + 1], g[a:a + 1], beta[a:a + 1], state[slot][None])
            out[a], state[slot] = o[0], s[0]
            continue
        seg = [t[a:a + n].transpose(0, 1) for t in (q, k, v, g, beta)]
        o, state[slot] = _chunked(*seg, state[slot])
        out[a:a + n] = o.transpose(0, 1)
    return out


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x over its last dim, times weight, times silu(gate), in float32 (norm before gate)."""
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x * F.silu(gate.float())
