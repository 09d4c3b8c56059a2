// One extension module per ISA build (vlite/_custom_ops.py compiles and picks it), from two
// translation units compiled side by side: quant_linear.cpp (the heaviest, ~28 s at -O3) and this
// one with the rest. Both include ATen alone and this one torch's pybind11 casters, not
// <torch/extension.h>: that pulls in the whole C++ frontend, 37 s of parsing per file here.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include "ops.h"
#include "attention_chunk.cpp"
#include "decode_attention.cpp"
#include "cascade_attention.cpp"
#include "prefill_attention.cpp"
#include "layer_ops.cpp"
#include "lora.cpp"  // before decode_layer.cpp, which applies its LoRALinear
#include "decode_layer.cpp"
#include "gguf_tiles.cpp"
#include "memory_bandwidth.cpp"
#include "dense_linear.cpp"
#include "gated_delta_chunk.cpp"  // before gated_delta.cpp, which runs its recurrent and chunked forms
#include "gated_delta.cpp"

std::string isa() {
#if defined(__AVX512VNNI__) && defined(VLITE_AVX512)
  return std::string(VLITE_ISA_NAME) + "+vnni";
#else
  return VLITE_ISA_NAME;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &isa, "the instruction set this build was compiled for");
  m.def("paged_decode_attention", &vlite::paged_decode_attention, pybind11::arg("query"), pybind11::arg("key_cache"),
        pybind11::arg("value_cache"), pybind11::arg("block_table"), pybind11::arg("seq_lens"), pybind11::arg("scale"),
        pybind11::arg("window") = 0, pybind11::arg("num_prefix_blocks") = 0, pybind11::arg("sinks") = pybind11::none());
  m.def("prefill_attention", &vlite::prefill_attention, pybind11::arg("query"), pybind11::arg("key_cache"),
        pybind11::arg("value_cache"), pybind11::arg("block_ids"), pybind11::arg("context_len"), pybind11::arg("scale"),
        pybind11::arg("sinks") = pybind11::none(), "causal attention of one request's prompt chunk [Q, H, D] at positions context_len.. over its blocks");
  m.def("tile_gguf", &vlite::tile_gguf, pybind11::arg("raw"), pybind11::arg("code"), pybind11::arg("k"),
        pybind11::arg("qt"), pybind11::arg("scales"), pybind11::call_guard<pybind11::gil_scoped_release>(),
        "GGUF Q4_0/Q4_K/Q5_K/Q6_K rows -> the kernels' tiles (without the GIL: the tokenizer loads meanwhile)");
  m.def("read_bandwidth", &vlite::read_bandwidth, pybind11::arg("buf"), pybind11::arg("iters") = 5,
        "GB/s of the best of `iters` multi-threaded streaming reads of a uint8 buffer");
  m.def("quantize_activations", &vlite::quantize_activations, pybind11::arg("x"), pybind11::arg("precise") = false);
  m.def("tile_rows", &vlite::tile_rows, "output rows per tile of the packed weight layout");
  m.def("precise_max_rows", &vlite::precise_max_rows,
        "float32 activations get an int8 residual row in steps of at most this many rows");
  m.def("quant_linear", &vlite::quant_linear, pybind11::arg("x"), pybind11::arg("qt"), pybind11::arg("scales"),
        pybind11::arg("mins"), pybind11::arg("fmt"), pybind11::arg("sub"), pybind11::arg("n"),
        pybind11::arg("residual") = pybind11::none(), pybind11::arg("precise") = pybind11::none(),
        pybind11::arg("out_dtype") = pybind11::none(), pybind11::arg("precise_rows") = pybind11::none());
  m.def("dense_linear", &vlite::dense_linear, pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("bias"),
        pybind11::arg("residual"), "float32 x [M, K] @ w [N, K]^T (+ bias) (+ residual) for steps of a few rows");
  m.def("dense_max_rows", &vlite::dense_max_rows, "the most rows a step runs on dense_linear (above: torch's GEMM)");
  m.def("write_kv_cache", &vlite::write_kv_cache);
  pybind11::class_<vlite::PackedLinear>(m, "PackedLinear", pybind11::module_local())  // one per ISA module
      .def(pybind11::init<at::Tensor, at::Tensor, c10::optional<at::Tensor>, int64_t, int64_t, int64_t,
                          c10::optional<bool>>());
  pybind11::class_<vlite::LlamaDecodeStack>(m, "LlamaDecodeStack", pybind11::module_local())
      .def(pybind11::init<>())
      .def("add_layer", &vlite::LlamaDecodeStack::add_layer)
      .def("set_lora", &vlite::LlamaDecodeStack::set_lora, pybind11::arg("layer_index"), pybind11::arg("qkv"),
           pybind11::arg("o"), pybind11::arg("gate_up"), pybind11::arg("down"))
      .def("forward", &vlite::LlamaDecodeStack::forward, pybind11::arg("hidden"), pybind11::arg("cos"),
           pybind11::arg("signed_sin"), pybind11::arg("kv_caches"), pybind11::arg("slot_mapping"),
           pybind11::arg("block_table"), pybind11::arg("seq_lens"), pybind11::arg("scale"),
           pybind11::arg("precise_rows"), pybind11::arg("num_prefix_blocks") = 0);
  // shared_ptr holders: every LoRALinear of a step reads one mapping, and the decode stack holds them
  pybind11::class_<vlite::LoRAMapping, std::shared_ptr<vlite::LoRAMapping>>(m, "LoRAMapping", pybind11::module_local())
      .def(pybind11::init<>())
      .def("set", &vlite::LoRAMapping::set, pybind11::arg("token_slot"))
      .def("clear", &vlite::LoRAMapping::clear)
      .def("has_lora", &vlite::LoRAMapping::has_lora)
      .def("num_tokens", &vlite::LoRAMapping::num_tokens);
  pybind11::class_<vlite::LoRALinear, std::shared_ptr<vlite::LoRALinear>>(m, "LoRALinear", pybind11::module_local())
      .def(pybind11::init<std::shared_ptr<vlite::LoRAMapping>, int64_t, int64_t, int64_t>(), pybind11::arg("mapping"),
           pybind11::arg("num_slots"), pybind11::arg("out_features"), pybind11::arg("in_features"))
      .def("set_slot", &vlite::LoRALinear::set_slot, pybind11::arg("slot"), pybind11::arg("modules"))
      .def("clear_slot", &vlite::LoRALinear::clear_slot, pybind11::arg("slot"))
      .def("apply", &vlite::LoRALinear::apply, pybind11::arg("out"), pybind11::arg("x"));
  m.def("gdn_conv1d", &vlite::gdn_conv1d, pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("conv_state"),
        pybind11::arg("state_idx"), pybind11::arg("query_start_loc"),
        "Gated DeltaNet's causal depthwise conv1d + SiLU over varlen requests, conv_state [S, C, K-1] in place");
  m.def("gated_delta_rule", &vlite::gated_delta_rule, pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"),
        pybind11::arg("g"), pybind11::arg("beta"), pybind11::arg("state"), pybind11::arg("state_idx"),
        pybind11::arg("query_start_loc"), pybind11::arg("scale"), pybind11::arg("use_qk_l2norm") = true,
        pybind11::arg("chunked_min_tokens") = 0,
        "the gated delta rule over varlen requests (recurrent or chunked per segment), state [S, Hv, Dk, Dv] in place");
  m.def("gdn_gated_rms_norm", &vlite::gdn_gated_rms_norm, pybind11::arg("x"), pybind11::arg("z"),
        pybind11::arg("weight"), pybind11::arg("eps"), "x * rsqrt(mean(x^2) + eps) * weight * silu(z), float32");
  m.def("rms_norm", &vlite::rms_norm);
  m.def("silu_and_mul", &vlite::silu_and_mul);
  m.def("rotary_inplace", &vlite::rotary_inplace);
  m.def("dequantize", &vlite::dequantize, pybind11::arg("qt"), pybind11::arg("scales"), pybind11::arg("mins"),
        pybind11::arg("fmt"), pybind11::arg("sub"), pybind11::arg("n"), pybind11::arg("dtype"),
        pybind11::arg("out") = pybind11::none(), pybind11::arg("rows") = pybind11::none());
}
