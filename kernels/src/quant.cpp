// QLoRA's frozen base on CPU: y = x W^T and its input gradient dx = dy W for a W kept in MLX's
// affine quantized layout (mx.quantize: w uint32 (N, K * bits / 32), scales and biases
// (N, K / group)). A slab of W's rows at a time is dequantized on the kernels' threads
// (packed.h dequant_affine_row: mx.dequantize's values) into a buffer of the task's own and
// multiplied by the BLAS's SGEMM, so no float32 copy of W is ever an MLX array: nothing the
// graph could hold past the product, and the GEMM runs at the BLAS's float32 rate where MLX's
// CPU quantized matmul runs at a few GFLOP/s. A frozen base needs no weight gradient.

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "blas.h"
#include "copy.h"
#include "kernels.h"
#include "packed.h"
#include "pool.h"
#include "qgemv.h"

namespace mlxtoy {

class QuantLinear : public mx::Primitive {
 public:
  // a W^T, a W, W itself, a W^T for a few rows of a (decoding: the quantized GEMV, scales and
  // biases in their own dtype)
  enum class Op { Product, InputGrad, Dequantize, Gemv };
  // symmetric: the biases are -2^(bits - 1) scales (a Q4_0 / Q8_0 block's), which the GEMV may
  // then leave unread
  QuantLinear(mx::Stream stream, Op op, int group, int bits, bool symmetric = false)
      : mx::Primitive(stream), op_(op), group_(group), bits_(bits), symmetric_(symmetric) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[mlxtoy_kernels] CPU kernels only");
  }
  const char* name() const override { return "MlxtoyQuantLinear"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const QuantLinear&>(other);
    return op_ == o.op_ && group_ == o.group_ && bits_ == o.bits_ && symmetric_ == o.symmetric_;
  }

 private:
  Op op_;
  int group_, bits_;
  bool symmetric_;
};

namespace {

constexpr int64_t kSlabFloats = int64_t{1} << 22;  // 16 MB of dequantized rows a slab

void dequant_rows(const uint32_t* w, const float* scales, const float* biases, float* y, int64_t n, int64_t K,
                  int64_t group, int bits, Pool& threads) {
  const int64_t words = K * bits / 32, groups = K / group;
  threads.run(n, std::max<int64_t>(1, (int64_t{1} << 14) / K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (bits == 4)
        dequant_affine_row<4>(w + r * words, scales + r * groups, biases + r * groups, y + r * K, K, group);
      else
        dequant_affine_row<8>(w + r * words, scales + r * groups, biases + r * groups, y + r * K, K, group);
    }
  });
}


}  // namespace

void QuantLinear::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (auto& in : inputs) encoder.set_input_array(in);
  encoder.set_output_array(out);
  std::vector<StridedCopy> copies;
  std::vector<mx::array> temps;
  std::vector<const void*> in;
  for (auto& a : inputs) in.push_back(task_data(a, a.flags().row_contiguous, copies, temps));
  const int bits = bits_;
  const Op op = op_;
  const bool symmetric = symmetric_;
  // Dequantize: inputs (w, scales, biases); else (a, w, scales, biases)
  const int64_t first = op == Op::Dequantize ? 0 : 1;
  const int64_t group = group_, N = inputs[first].shape(0), K = inputs[first].shape(1) * (32 / bits);
  const int64_t M = first ? inputs[0].size() / std::max<int64_t>(inputs[0].shape(-1), 1) : 0;
  const int64_t slab = std::clamp<int64_t>(kSlabFloats / K, 1, N);
  float* y = out.data<float>();
  const ScaleType st = scale_type(inputs[first + 1]);
  encoder.dispatch([=, copies = std::move(copies), temps = std::move(temps)]() {
    for (const auto& c : copies) c.run();
    auto a = static_cast<const float*>(in[0]);
    auto w = static_cast<const uint32_t*>(in[first]);
    if (op == Op::Gemv) {
      qgemv(a, M, w, in[first + 1], in[first + 2], st, symmetric, y, N, K, group, bits, pool());
      return;
    }
    auto scales = static_cast<const float*>(in[first + 1]);
    auto biases = static_cast<const float*>(in[first + 2]);
    if (op == Op::Dequantize) {
      dequant_rows(w, scales, biases, y, N, K, group, bits, pool());
      return;
    }
    const int64_t words = K * bits / 32, groups = K / group;
    // one buffer per stream thread, kept: allocated when the task runs, not when it is queued
    // (MLX queues far ahead: a buffer per queued product would add up to GBs)
    static thread_local std::vector<float> slab_buffer;
    if (slab_buffer.size() < static_cast<size_t>(slab * K)) slab_buffer.resize(slab * K);
    float* buf = slab_buffer.data();
    for (int64_t n0 = 0; n0 < N; n0 += slab) {
      const int64_t n = std::min(slab, N - n0);
      dequant_rows(w + n0 * words, scales + n0 * groups, biases + n0 * groups, buf, n, K, group, bits, pool());
      if (op == Op::InputGrad)  // dx (M, K) += dy[:, n0:n0+n] @ W[n0:n0+n]
        blas_gemm(false, false, M, K, n, 1.0f, a + n0, N, buf, K, n0 == 0 ? 0.0f : 1.0f, y, K);
      else  // y[:, n0:n0+n] = x @ W[n0:n0+n]^T
        blas_gemm(false, true, M, n, K, 1.0f, a, K, buf, K, 0.0f, y + n0, N);
    }
  });
}

namespace {

void check_layout(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size, int bits,
                  const char* what) {
  if ((bits != 4 && bits != 8) || group_size <= 0 || group_size % (32 / bits))
    throw std::invalid_argument(std::string("[mlxtoy_kernels] ") + what + ": bits 4 or 8, a group of whole words");
  if (w.ndim() != 2 || w.dtype() != mx::uint32 || scales.ndim() != 2 || scales.shape() != biases.shape() ||
      scales.shape(0) != w.shape(0) || static_cast<int64_t>(w.shape(1)) * (32 / bits) != scales.shape(1) * group_size)
    throw std::invalid_argument(std::string("[mlxtoy_kernels] ") + what +
                                ": w (N, K * bits / 32) uint32, scales and biases (N, K / group_size)");
}

mx::array make(QuantLinear::Op op, mx::Shape shape, std::vector<mx::array> inputs, int group_size, int bits,
               mx::StreamOrDevice s, bool symmetric = false) {
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) throw std::invalid_argument("[mlxtoy_kernels] CPU stream only");
  // the GEMV reads float16, bfloat16 or float32 scales and biases as they are (alike); the rest float32
  const auto dt = inputs[inputs.size() - 2].dtype();
  const bool own = op == QuantLinear::Op::Gemv && inputs.back().dtype() == dt &&
                   (dt == mx::float16 || dt == mx::bfloat16 || dt == mx::float32);
  if (!own)
    for (size_t i = inputs.size() - 2; i < inputs.size(); ++i) inputs[i] = mx::astype(inputs[i], mx::float32, stream);
  return mx::array(std::move(shape), mx::float32, std::make_shared<QuantLinear>(stream, op, group_size, bits, symmetric),
                   std::move(inputs));
}

}  // namespace

mx::array quant_linear(const mx::array& a, const mx::array& w, const mx::array& scales, const mx::array& biases,
                       int group_size, int bits, bool grad, bool symmetric, bool inference,
                       mx::StreamOrDevice s) {
  check_layout(w, scales, biases, group_size, bits, "quant_linear");
  const int64_t N = w.shape(0), K = w.shape(1) * (32 / bits);
  if (a.ndim() != 2 || a.dtype() != mx::float32 || a.shape(1) != (grad ? N : K))
    throw std::invalid_argument("[mlxtoy_kernels] quant_linear: a float32 (M, K), or (M, N) for the gradient");
  const bool few = (a.shape(0) <= kGemvRows && group_size % kChunk == 0) ||
                   (inference && a.shape(0) <= gemv_max_rows(K, group_size, bits));
  const auto op = grad ? QuantLinear::Op::InputGrad : few ? QuantLinear::Op::Gemv : QuantLinear::Op::Product;
  return make(op, {a.shape(0), static_cast<int>(grad ? K : N)}, {a, w, scales, biases}, group_size, bits, s,
              symmetric);
}

mx::array dequantize_affine(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size,
                            int bits, mx::StreamOrDevice s) {
  check_layout(w, scales, biases, group_size, bits, "dequantize_affine");
  return make(QuantLinear::Op::Dequantize, {w.shape(0), w.shape(1) * (32 / bits)}, {w, scales, biases}, group_size,
              bits, s);
}

}  // namespace mlxtoy
