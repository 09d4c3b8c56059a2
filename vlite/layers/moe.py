"""The mixture-of-experts feed-forward block (Qwen3-MoE, OLMoE, Mixtral, gpt-oss), computed as vLLM's FusedMoE
computes it, in torch:

    probs        = softmax(x @ Wgate.T)                       (float32)
    weights, ids = topk(probs, k)                             (k = num_experts_per_tok)
    weights     /= weights.sum()                              (norm_topk_prob; Mixtral always)

    (gpt-oss, router_topk_softmax: logits = x @ Wgate.T + b, ids = topk(logits, k), weights = softmax over those k)
    out[t]       = sum_j weights[t, j] * expert[ids[t, j]](x[t])   (each expert a gated MLP)

Batched per expert, whatever the mix of prefill chunks and decodes in the step: the step's
(token, expert) pairs are sorted by expert, each expert that received tokens runs once over all of
its rows (one gate/up and one down matmul, packed on the kernels when the plan quantizes), and the
weighted rows are added back to their tokens with one index_add_. Python loops over the experts
that have tokens, never over tokens. Within each token the experts' outputs are summed in ascending
expert order from zero, as transformers sums them, so float32 results match it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from vlite.layers.linear import Weights, param
from vlite.layers.mlp import GatedMLP
from vlite.layers.quantization import QuantizationPlan
from vlite.model_arch import ModelArchConfig


def route(logits: torch.Tensor, top_k: int, renormalize: bool, topk_softmax: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and their weights, [tokens, top_k] each: softmax over all experts in
    float32, the top_k best, renormalized to sum to 1 where the model says (transformers' routers of
    Qwen3-MoE, OLMoE and Mixtral alike; top-k of the softmax is top-k of the logits). `topk_softmax`: the top_k
    logits, then a softmax over them (gpt-oss's router: the same weights as renormalizing, its rounding)."""
    if topk_softmax:
        top, ids = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, ids


class SparseMoE(nn.Module):
    """A router (dense whatever the plan: its small matmul decides which experts run) over
    num_experts `GatedMLP`s of width moe_intermediate_size, read from `{prefix}.gate` and
    `{prefix}.experts.{e}.{gate,up,down}` under the checkpoint's names (`cfg.expert_names`); with `mlp_bias`
    the router and every expert have biases (gpt-oss)."""

    def __init__(self, cfg: ModelArchConfig, w: Weights, prefix: str, plan: QuantizationPlan,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.topk_softmax = cfg.router_topk_softmax
        self.gate_weight = param(w[f"{prefix}.gate.weight"].to(dtype))
        self.gate_bias = param(w[f"{prefix}.gate.bias"].to(dtype)) if cfg.mlp_bias else None
        names = cfg.expert_names
        kinds = ("weight", "bias") if cfg.mlp_bias else ("weight",)
        self.experts = nn.ModuleList(
            GatedMLP(cfg, {f"expert.{shared}.{kind}": w[f"{prefix}.experts.{e}.{name}.{kind}"]
                           for shared, name in zip(("gate_proj", "up_proj", "down_proj"), names) for kind in kinds},
                     "expert", plan, dtype, intermediate_size=cfg.moe_intermediate_size, torch_linears=True)
            for e in range(cfg.num_experts))
        self._expert_list = list(self.experts)  # indexed per step without nn.ModuleList's lookups

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None,
                precise_rows: Optional[int] = None) -> torch.Tensor:
        """The block's output for x [tokens, hidden], plus `residual` (the layer's skip connection);
        `precise_rows` as GatedMLP's (None: each expert's call counts its own rows)."""
        weights, ids = route(F.linear(x, self.gate_weight, self.gate_bias), self.top_k, self.renormalize,
                             self.topk_softmax)
        out = self.experts_sum(x, weights, ids, precise_rows)
        return out if residual is None else out + residual

    def experts_sum(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    precise_rows: Optional[int] = None) -> torch.Tensor:
        """sum_j weights[t, j] * expert[ids[t, j]](x[t]) for each token t of x [tokens, hidden] (ids, weights:
        [tokens, top_k], the routing)."""
        n = x.shape[0]
        # The pairs rank-major (rank j, then token): a stable sort by expert keeps, within each expert,
        # transformers' row order, and the rows of one token in ascending expert order.
        flat = ids.t().reshape(-1)
        order = torch.argsort(flat, stable=True)
        tokens = order % n
        rows = x.index_select(0, tokens)
        out_rows = torch.empty_like(rows)
        start = 0
        for e, count in enumerate(torch.bincount(flat, minlength=self.num_experts).tolist()):
            if count:
                out_rows[start:start + count] = self._expert_list[e](rows[start:start + count],
                                                                     precise_rows=precise_rows)
                start += count
        out_rows *= weights.t().reshape(-1)[order].to(x.dtype)[:, None]
        return torch.zeros_like(x).index_add_(0, tokens, out_rows)


class SharedExpertMoE(SparseMoE):
    """SparseMoE plus one always-on shared expert (a gated MLP of `shared_expert_intermediate_size`) whose output is
    scaled per token by sigmoid(x @ shared_expert_gate) and added to the routed experts' sum (Qwen3.5-MoE,
    Qwen3-Next, Qwen2-MoE)."""

    def __init__(self, cfg: ModelArchConfig, w: Weights, prefix: str, plan: QuantizationPlan,
                 dtype: torch.dtype) -> None:
        super().__init__(cfg, w, prefix, plan, dtype)
        self.shared_expert = GatedMLP(cfg, w, f"{prefix}.shared_expert", plan, dtype,
                                      intermediate_size=cfg.shared_expert_intermediate_size, torch_linears=True)
        self.shared_expert_gate = param(w[f"{prefix}.shared_expert_gate.weight"].to(dtype))

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None,
                precise_rows: Optional[int] = None) -> torch.Tensor:
        shared = self.shared_expert(x, precise_rows=precise_rows) * torch.sigmoid(F.linear(x, self.shared_expert_gate))
        out = super().forward(x, precise_rows=precise_rows) + shared
        return out if residual is None else out + residual
