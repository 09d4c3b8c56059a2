// The kernels' entry points, shared by the two translation units of a build (quant_linear.cpp,
// compiled on its own, and bindings.cpp with the rest), so that ninja compiles them side by side.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace vlite {

// quant_linear.cpp
at::Tensor quant_linear(at::Tensor x, at::Tensor qt, at::Tensor st, c10::optional<at::Tensor> mt, int64_t fmt,
                        int64_t sub, int64_t N, c10::optional<at::Tensor> residual = c10::nullopt,
                        c10::optional<bool> precise_opt = c10::nullopt,
                        c10::optional<at::ScalarType> out_dtype = c10::nullopt,
                        c10::optional<int64_t> precise_rows = c10::nullopt);
std::vector<at::Tensor> quantize_activations(at::Tensor x, bool precise);
at::Tensor dequantize(at::Tensor qt, at::Tensor st, c10::optional<at::Tensor> mt, int64_t fmt, int64_t sub, int64_t N,
                      at::ScalarType dtype, c10::optional<at::Tensor> out_buffer, c10::optional<at::Tensor> rows);
int64_t tile_rows();         // output rows per tile of the packed weight layout
int64_t precise_max_rows();  // float32 activations get a residual row in steps of at most this many rows

// dense_linear.cpp
at::Tensor dense_linear(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias,
                        c10::optional<at::Tensor> residual);
int64_t dense_max_rows();  // steps of more rows: torch's GEMM is as fast

}  // namespace vlite
