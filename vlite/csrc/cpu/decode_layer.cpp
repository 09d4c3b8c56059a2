// One Llama-style decoder layer for a step of decode tokens, in a single call: the same kernels the
// Python layer calls one by one (rms_norm, quant_linear, rotary_inplace, write_kv_cache,
// paged_decode_attention, silu_and_mul), minus ~10 Python-level calls per layer. At one token
// per request, those calls cost about as much as the arithmetic.
#include <ATen/ATen.h>

#include <array>
#include <memory>

#include "ops.h"

namespace vlite {

struct PackedLinear {
  at::Tensor qt, scales;
  c10::optional<at::Tensor> mins;
  int64_t fmt, sub, n;
  c10::optional<bool> precise;  // None: float32 activations get the residual row
};

// One projection: its packed weight, or the row groups of a fused one whose parts differ in GGUF type
// (Q4_K_M's Q4_K q/k and Q6_K v), run one after the other and concatenated
using PackedParts = std::vector<PackedLinear>;

// `precise_rows`: the row count that decides the float32 residual row (quant_linear), None: x's
static at::Tensor run_linear(const at::Tensor& x, const PackedParts& parts, c10::optional<int64_t> precise_rows,
                             c10::optional<at::Tensor> residual = c10::nullopt) {
  if (parts.size() == 1) {
    const PackedLinear& w = parts[0];
    return quant_linear(x, w.qt, w.scales, w.mins, w.fmt, w.sub, w.n, residual, w.precise, c10::nullopt,
                        precise_rows);
  }
  std::vector<at::Tensor> outs;
  for (const PackedLinear& w : parts) outs.push_back(quant_linear(x, w.qt, w.scales, w.mins, w.fmt, w.sub, w.n,
                                                                  c10::nullopt, w.precise, c10::nullopt,
                                                                  precise_rows));
  auto out = at::cat(outs, 1);
  return residual.has_value() ? out + *residual : out;
}

// One layer's weights: norms, the packed qkv, o, gate_up and down projections (row-tiled qt, scales,
// mins or None, fmt, sub, rows), the qkv bias if any, and its head counts.
struct LlamaLayer {
  at::Tensor input_norm, post_norm;
  double eps;
  std::vector<PackedParts> linears;
  c10::optional<at::Tensor> qkv_bias;
  int64_t num_heads, num_kv_heads, head_dim;
  std::array<std::shared_ptr<LoRALinear>, 4> lora;  // qkv, o, gate_up, down: null where none (lora.cpp)
};

// hidden [T, hidden] (every token a decode) -> the layer's output hidden [T, hidden]
static at::Tensor llama_decode_layer(at::Tensor hidden, const LlamaLayer& l, const at::Tensor& cos,
                                     const at::Tensor& signed_sin, const at::Tensor& kv_cache,
                                     const at::Tensor& slot_mapping, const at::Tensor& block_table,
                                     const at::Tensor& seq_lens, double scale, c10::optional<int64_t> precise_rows,
                                     int64_t num_prefix_blocks) {
  const int64_t T = hidden.size(0), num_heads = l.num_heads, num_kv_heads = l.num_kv_heads, head_dim = l.head_dim;
  auto x = rms_norm(hidden, l.input_norm, l.eps);
  auto qkv = run_linear(x, l.linears[0], precise_rows);
  if (l.qkv_bias.has_value()) qkv.add_(*l.qkv_bias);
  if (l.lora[0]) l.lora[0]->apply(qkv, x);
  rotary_inplace(qkv, num_heads + num_kv_heads, head_dim, cos, signed_sin);
  auto qkv3 = qkv.view({T, num_heads + 2 * num_kv_heads, head_dim});
  auto k = qkv3.narrow(1, num_heads, num_kv_heads), v = qkv3.narrow(1, num_heads + num_kv_heads, num_kv_heads);
  write_kv_cache(k, v, kv_cache, slot_mapping);
  auto o = paged_decode_attention(qkv3.narrow(1, 0, num_heads), kv_cache.select(0, 0), kv_cache.select(0, 1),
                                  block_table, seq_lens, scale, 0, num_prefix_blocks).view({T, num_heads * head_dim});
  auto h = run_linear(o, l.linears[1], precise_rows, hidden.contiguous());
  if (l.lora[1]) l.lora[1]->apply(h, o);
  auto y = rms_norm(h, l.post_norm, l.eps);
  auto gate_up = run_linear(y, l.linears[2], precise_rows);
  if (l.lora[2]) l.lora[2]->apply(gate_up, y);
  auto act = silu_and_mul(gate_up);
  auto out = run_linear(act, l.linears[3], precise_rows, h);
  if (l.lora[3]) l.lora[3]->apply(out, act);
  return out;
}

// A model's decoder layers for all-decode steps, held once: a step runs them in one call (a Python
// loop over the layers converted each one's ~20 arguments again (pybind), ran the interpreter between
// layers and left the second thread spinning meanwhile).
struct LlamaDecodeStack {
  std::vector<LlamaLayer> layers;

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, double eps, std::vector<PackedParts> linears,
                 c10::optional<at::Tensor> qkv_bias, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
    TORCH_CHECK(linears.size() == 4, "LlamaDecodeStack: qkv, o, gate_up, down");
    layers.push_back({input_norm, post_norm, eps, std::move(linears), qkv_bias, num_heads, num_kv_heads, head_dim,
                      {}});
  }

  // layer `index`'s LoRA updates, applied right after each projection (None: that one has none)
  void set_lora(int64_t index, std::shared_ptr<LoRALinear> qkv, std::shared_ptr<LoRALinear> o,
                std::shared_ptr<LoRALinear> gate_up, std::shared_ptr<LoRALinear> down) {
    TORCH_CHECK(index >= 0 && index < (int64_t)layers.size(), "LlamaDecodeStack.set_lora: layer ", index,
                " is out of range for ", layers.size(), " layers");
    layers[index].lora = {std::move(qkv), std::move(o), std::move(gate_up), std::move(down)};
  }

  // hidden [T, hidden] after the embedding; kv_caches: one per layer; returns the last layer's output.
  // precise_rows: the step's row count that decides the float32 residual row (None: T);
  // num_prefix_blocks > 0: the rows share their first that many blocks (cascade attention)
  at::Tensor forward(at::Tensor hidden, at::Tensor cos, at::Tensor signed_sin,
                     const std::vector<at::Tensor>& kv_caches, at::Tensor slot_mapping,
                     at::Tensor block_table, at::Tensor seq_lens, double scale,
                     c10::optional<int64_t> precise_rows, int64_t num_prefix_blocks = 0) const {
    TORCH_CHECK(kv_caches.size() == layers.size(), "LlamaDecodeStack: ", layers.size(), " layers but ",
                kv_caches.size(), " KV caches");
    for (size_t i = 0; i < layers.size(); ++i)
      hidden = llama_decode_layer(hidden, layers[i], cos, signed_sin, kv_caches[i], slot_mapping, block_table,
                                  seq_lens, scale, precise_rows, num_prefix_blocks);
    return hidden;
  }
};

}  // namespace vlite
