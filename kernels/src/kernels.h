// mlxtoy's CPU kernels as MLX primitives (see kernels.cpp).
#pragma once

#include <optional>
#include <string>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace mlxtoy {

class Kernel : public mx::Primitive {
 public:
  enum class Op { Softmax, SoftmaxGrad, CrossEntropyColumns, CrossEntropyColumnsGrad, RmsNorm, RmsNormGrad, Swiglu, SwigluGrad, GemvMany,
                  DecodeAttention, AdamW, SumSquares, Rope, LogSumExp, ArgMax, Pack, GemvPacked,
                  GemmMany, Gemm };

  // param: the norms' eps, the attention's or RoPE's scale; iparam: RoPE's 2 * dims + traditional,
  // a packing's bits
  Kernel(mx::Stream stream, Op op, float param, int iparam = 0)
      : mx::Primitive(stream), op_(op), param_(param), iparam_(iparam) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxtoyKernel"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  Op op_;
  float param_;
  int iparam_;
};

// DecodeBlock's codes for a matrix in MLX's affine layout (groups of 32), beside packed.h's Pack codes
constexpr int kAffine4 = 3, kAffine8 = 7;

// One pre-norm Llama block for one decoded token (B = 1, T = 1), as one task on the kernels'
// threads in phases (see decode.cpp).
class DecodeBlock : public mx::Primitive {
 public:
  // packed: for weights[w] of decode_block (a matrix: q, k, v, o, gate, up, down), bits
  // 3 (w - 1) .. 3 (w - 1) + 2: 0 float32, 1 Q4-packed, 2 Q8-packed (see pack), 3 MLX's affine 4-bit
  // layout (groups of 32: kAffine4), 4 Q5-packed, 5 Q4_0- and 6 Q8_0-packed, 7 MLX's affine 8-bit
  // layout (kAffine8); affine: for an affine matrix, bits 3 (w - 1) .. + 2: its scales' ScaleType,
  // then whether it is symmetric; low_rank: bit m (m of q, k, v, o, gate, up, down) set where the
  // matrix has a low-rank update added to its products (an adapter's: decode.cpp's LowRank), bit
  // 7 + m where DoRA's rescale follows it
  DecodeBlock(mx::Stream stream, int rope_dims, bool traditional, bool qkv_bias, int low_rank, float eps,
              float attn_scale, float rope_scale, int packed, int affine)
      : mx::Primitive(stream), rope_dims_(rope_dims), traditional_(traditional), qkv_bias_(qkv_bias),
        low_rank_(low_rank), eps_(eps), attn_scale_(attn_scale), rope_scale_(rope_scale), packed_(packed),
        affine_(affine) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxtoyDecodeBlock"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int rope_dims_;
  bool traditional_, qkv_bias_;
  int low_rank_;
  float eps_, attn_scale_, rope_scale_;
  int packed_, affine_;
};

// MLX's affine quantized matrix (w uint32 (rows, d_in * bits / 32), scales and biases
// (rows, d_in / group_size)) to float32 (rows, d_in), threaded (quant.cpp)
mx::array dequantize_affine(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size,
                            int bits, mx::StreamOrDevice st = {});

// x @ W.T (grad: dy @ W) for W in that layout, a slab of rows dequantized at a time into the
// BLAS's SGEMM (quant.cpp); a (M, K), or (M, N) for the gradient, float32
mx::array quant_linear(const mx::array& a, const mx::array& w, const mx::array& scales, const mx::array& biases,
                       int group_size, int bits, bool grad, bool symmetric = false, bool inference = false,
                       mx::StreamOrDevice st = {});


// GGUF blocks (GGMLQuantizationType `type`) to float32, as gguf-py computes them (dequant.cpp)
bool dequantizes(int type);
void dequantize(const uint8_t* data, int64_t n_bytes, int type, float* out, int64_t n_values);
// `blocks` Q4_0 / Q4_1 / Q8_0 blocks (`type` 2, 3, 8) as MLX's affine layout, group 32: the
// packed bytes (16 or 32 a block), each block's scale (its float16 bits) and bias (float32), threaded
void affine_blocks(const uint8_t* data, int64_t n_bytes, int type, int64_t blocks, uint8_t* packed,
                   uint16_t* scales, float* biases);

int kernel_threads();
bool kernel_openmp();
// the instruction forms the kernels take here: "avx512", "avx2" or "portable"
const char* kernel_forms();
// whether the block attention's GEMMs can each run on one of the kernels' threads (MKL's OpenMP
// team, or an OpenBLAS whose thread count it sets)
bool block_attention_ok();
mx::array softmax_bias(const mx::array& s, const mx::array& bias, mx::StreamOrDevice st = {});
mx::array softmax_grad(const mx::array& p, const mx::array& dp, mx::StreamOrDevice st = {});
std::vector<mx::array> cross_entropy_columns(const mx::array& logits_t, const mx::array& targets, bool grad,
                                             mx::StreamOrDevice st = {});
mx::array rms_norm(const mx::array& x, const mx::array& w, float eps, mx::StreamOrDevice st = {});
std::vector<mx::array> rms_norm_grad(const mx::array& x, const mx::array& w, const mx::array& g, float eps,
                                     mx::StreamOrDevice st = {});
mx::array swiglu(const mx::array& a, const mx::array& b, mx::StreamOrDevice st = {});
std::vector<mx::array> swiglu_grad(const mx::array& a, const mx::array& b, const mx::array& g,
                                   mx::StreamOrDevice st = {});
mx::array gemv(const mx::array& x, const mx::array& w, mx::StreamOrDevice st = {});
std::vector<mx::array> gemv_many(const mx::array& x, const std::vector<mx::array>& ws, mx::StreamOrDevice st = {});
// the same products for many rows of x (prefill), on AVX-512 CPUs (gemm.h)
bool gemm_ok();
std::vector<mx::array> gemm_many(const mx::array& x, const std::vector<mx::array>& ws, mx::StreamOrDevice st = {});
// op(a) @ op(b) (op: a transposition where asked), or its transpose with trans_out
mx::array gemm(const mx::array& a, const mx::array& b, bool trans_a, bool trans_b, bool trans_out,
               mx::StreamOrDevice st = {});
mx::array decode_attention(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& bias,
                           float scale, mx::StreamOrDevice st = {});
std::vector<mx::array> attention(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& bias,
                                 float scale, mx::StreamOrDevice st = {});
std::vector<mx::array> attention_grad(const mx::array& q, const mx::array& k, const mx::array& v,
                                      const mx::array& bias, const mx::array& stats, const mx::array& d_out,
                                      float scale, mx::StreamOrDevice st = {});
mx::array sum_squares(const mx::array& x, mx::StreamOrDevice st = {});
mx::array logsumexp(const mx::array& x, mx::StreamOrDevice st = {});
mx::array argmax(const mx::array& x, mx::StreamOrDevice st = {});
std::vector<mx::array> pack(const mx::array& w, const std::string& form, mx::StreamOrDevice st = {});
mx::array gemv_packed(const mx::array& x, const mx::array& packed, mx::StreamOrDevice st = {});
// the rows of a packed W in `form` one row of x takes a pass (0: packs are unpacked here); set:
// 1, 2, 4 or 8 from now on (0: the built-in choice again)
int packed_row_pass(const std::string& form);
void set_packed_row_pass(const std::string& form, int rows);
std::vector<mx::array> adamw(const mx::array& p, const mx::array& g, const mx::array& m, const mx::array& v,
                             const mx::array& scalars, mx::StreamOrDevice st = {});
mx::array rope(const mx::array& x, const mx::array& offset, const mx::array& inv_freqs, int dims, bool traditional,
               float scale, mx::StreamOrDevice st = {});

std::vector<mx::array> decode_block(const mx::array& x, const std::vector<mx::array>& weights,
                                    const std::vector<mx::array>& biases, const mx::array& keys,
                                    const mx::array& values, const mx::array& offset, const mx::array& inv_freqs,
                                    int rope_dims, bool traditional, float eps, float attn_scale, float rope_scale,
                                    const std::optional<mx::array>& starts, const std::vector<mx::array>& affine = {},
                                    int symmetric = 0, const std::vector<mx::array>& low_rank = {},
                                    int low_rank_of = 0, int dora_of = 0,
                                    const std::optional<mx::array>& ids = std::nullopt,
                                    mx::StreamOrDevice st = {});

}  // namespace mlxtoy
