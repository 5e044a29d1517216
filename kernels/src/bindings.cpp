#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "kernels.h"
#include "loops.h"  // half_exact
#include "qgemv.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_ext, m) {
  m.doc() = "mlxtoy's float32 CPU kernels as MLX primitives";
  m.def("threads", &mlxtoy::kernel_threads, "threads the kernels split rows over");
  m.def("forms", &mlxtoy::kernel_forms,
        "the instruction forms the kernels take here: avx512, avx2 (an AVX2-only CPU, or MLXTOY_KERNEL_AVX512=0) or portable");
  m.def("openmp", &mlxtoy::kernel_openmp, "whether they run on the OpenMP threads MKL runs on (else their own)");
  m.def("block_attention_ok", &mlxtoy::block_attention_ok,
        "whether the block attention's GEMMs can run one per kernel thread (MKL's team, or an OpenBLAS told so)");
  m.def("softmax_bias", &mlxtoy::softmax_bias, "s"_a, "bias"_a, nb::kw_only(), "stream"_a = nb::none(),
        "softmax(s + bias) over the last axis; s (B, ..., T, S), bias (1|B, T, S) of 0 and -inf");
  m.def("softmax_grad", &mlxtoy::softmax_grad, "p"_a, "dp"_a, nb::kw_only(), "stream"_a = nb::none(),
        "p * (dp - sum(p * dp, -1)): softmax's input gradient");
  m.def("cross_entropy_columns", &mlxtoy::cross_entropy_columns, "logits_t"_a, "targets"_a, "grad"_a,
        nb::kw_only(), "stream"_a = nb::none(),
        "cross_entropy for logits laid out (V, N); the gradient is (V, N) too");
  m.def("rms_norm", &mlxtoy::rms_norm, "x"_a, "w"_a, "eps"_a, nb::kw_only(), "stream"_a = nb::none());
  m.def("rms_norm_grad", &mlxtoy::rms_norm_grad, "x"_a, "w"_a, "g"_a, "eps"_a, nb::kw_only(),
        "stream"_a = nb::none(), "(dx, dw) of rms_norm for the output cotangent g");
  m.def("swiglu", &mlxtoy::swiglu, "a"_a, "b"_a, nb::kw_only(), "stream"_a = nb::none(), "silu(a) * b");
  m.def("swiglu_grad", &mlxtoy::swiglu_grad, "a"_a, "b"_a, "g"_a, nb::kw_only(), "stream"_a = nb::none());
  m.def("gemv", &mlxtoy::gemv, "x"_a, "w"_a, nb::kw_only(), "stream"_a = nb::none(),
        "x @ w.T for few rows of x (decoding), split over threads by w's rows");
  m.def("gemv_many", &mlxtoy::gemv_many, "x"_a, "ws"_a, nb::kw_only(), "stream"_a = nb::none(),
        "[x @ w.T for w in ws] in one call (one split over threads for all of them); a weight (..., K) of more axes gives x.shape[:-1] + w.shape[:-1] (a per-head (H, Dh, K) weight: (..., H, Dh))");
  m.def("dequantize_affine", &mlxtoy::dequantize_affine, "w"_a, "scales"_a, "biases"_a, "group_size"_a, "bits"_a,
        nb::kw_only(), "stream"_a = nb::none(),
        "mx.dequantize's float32 values for an affine-quantized matrix (2-D), threaded");
  m.def("quant_linear", &mlxtoy::quant_linear, "a"_a, "w"_a, "scales"_a, "biases"_a, "group_size"_a, "bits"_a,
        "grad"_a = false, nb::kw_only(), "symmetric"_a = false, "inference"_a = false,
        "stream"_a = nb::none(),
        "a @ W.T for an affine-quantized W (grad: a @ W, the input gradient), a slab of W dequantized at a time "
        "into the BLAS's SGEMM; symmetric: the biases are -2^(bits - 1) scales (Q4_0 / Q8_0 blocks), which "
        "decoding's GEMV then need not read; inference: more rows than decoding's (a prompt) may take the "
        "GEMV's VNNI form too (x rounded to 16 bits a group; no gradient)");
  m.def("quant_vnni_ok", &mlxtoy::cpu_vnni,
        "whether quant_linear's 4-bit GEMV (groups of 32) takes AVX-512 VNNI here (MLXTOY_KERNEL_VNNI=0: no)");
  m.def("quant_x16_ok", &mlxtoy::cpu_x16,
        "whether quant_linear's 4-bit GEMV (groups of 32) may take its AVX2 16-bit integer form here (where "
        "the VNNI form does not run; MLXTOY_KERNEL_VNNI=0: no)");
  m.def("quant_integer_form", &mlxtoy::integer_form, "K"_a, "group_size"_a, "bits"_a,
        "whether quant_linear's GEMV takes an integer form (VNNI or AVX2; x rounded to 16 bits a group) for a W of "
        "this width, group size and bits here: the form decode_block reads an affine 4-bit matrix in");
  m.def("quant_gemv_max_rows", &mlxtoy::gemv_max_rows, "K"_a, "group_size"_a, "bits"_a,
        "the most rows of x quant_linear(inference=True) takes through the GEMV for a W of this width, "
        "group size and bits (the VNNI and AVX2 integer forms' bounds, else the float32 form's), past which it "
        "takes the slabs");
  m.def("gemm_ok", &mlxtoy::gemm_ok, "whether gemm and gemm_many run here (an x86-64 CPU with AVX-512, or AVX2 and FMA)");
  m.def("gemm_many", &mlxtoy::gemm_many, "x"_a, "ws"_a, nb::kw_only(), "stream"_a = nb::none(),
        "gemv_many's products for many rows of x (prefill): an AVX-512 GEMM, no gradient");
  m.def("gemm", &mlxtoy::gemm, "a"_a, "b"_a, "trans_a"_a = false, "trans_b"_a = false, "trans_out"_a = false,
        nb::kw_only(), "stream"_a = nb::none(),
        "op(a) @ op(b) for 2-D float32 a and b, op a transposition where asked ((op(a) @ op(b)).T with "
        "trans_out): the AVX-512 GEMM, no gradient");
  m.def("decode_attention", &mlxtoy::decode_attention, "q"_a, "k"_a, "v"_a, "bias"_a, "scale"_a, nb::kw_only(),
        "stream"_a = nb::none(),
        "softmax(scale q k^T + bias) v for one query position: q (B, H, 1, D), k (B, KV, S, D), "
        "v (B, KV, S, Dv), bias (1|B, S) of 0 and -inf; query head h reads KV head h // (H / KV)");
  m.def("attention", &mlxtoy::attention, "q"_a, "k"_a, "v"_a, "bias"_a, "scale"_a, nb::kw_only(),
        "stream"_a = nb::none(),
        "(out, stats): out = softmax(scale q k^T + bias) v for q (B, KV, G * T, D) (each KV head's G query heads "
        "stacked along the rows), k (B, KV, S, D), v (B, KV, S, Dv), bias (1|B, T, S) additive; stats (B, KV, G * T, "
        "2) each row's max and 1 / sum (for the gradient); keys past a block of rows' last open one are not computed");
  m.def("attention_grad", &mlxtoy::attention_grad, "q"_a, "k"_a, "v"_a, "bias"_a, "stats"_a, "d_out"_a, "scale"_a,
        nb::kw_only(), "stream"_a = nb::none(),
        "(dq, dk, dv) of attention for out's cotangent d_out, from its stats (the probabilities are computed again)");
  m.def(
      "affine_blocks",
      [](nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> data, int type, int64_t rows,
         int64_t d_in) {
        const int bits = type == 8 ? 8 : 4;
        const int64_t groups = d_in / 32, blocks = rows * groups;
        auto* packed = new uint8_t[static_cast<size_t>(blocks * 4 * bits)];
        auto* scales = new uint16_t[static_cast<size_t>(blocks)];
        auto* biases = new float[static_cast<size_t>(blocks)];
        auto* halves = new uint16_t[static_cast<size_t>(blocks)];
        bool fits = true;
        {
          nb::gil_scoped_release unlocked;
          try {
            if (d_in % 32) throw std::invalid_argument("[mlxtoy_kernels] affine_blocks: d_in is not whole blocks");
            mlxtoy::affine_blocks(data.data(), static_cast<int64_t>(data.shape(0)), type, blocks, packed, scales,
                                  biases);
            for (int64_t b = 0; b < blocks && fits; ++b) fits = mlxtoy::half_exact(biases[b], halves[b]);
          } catch (...) {
            nb::gil_scoped_acquire locked;
            delete[] packed, delete[] scales, delete[] biases, delete[] halves;
            throw;
          }
        }
        mx::Shape shape{static_cast<int>(rows), static_cast<int>(groups)};
        mx::array w(packed, {static_cast<int>(rows), static_cast<int>(groups * bits)}, mx::uint32,
                    [](void* p) { delete[] static_cast<uint8_t*>(p); });
        mx::array s(scales, shape, mx::float16, [](void* p) { delete[] static_cast<uint16_t*>(p); });
        if (fits) {  // the biases as float16, as the scales
          delete[] biases;
          mx::array b(halves, shape, mx::float16, [](void* p) { delete[] static_cast<uint16_t*>(p); });
          return nb::make_tuple(w, s, b, bits);
        }
        delete[] halves;  // a bias beyond float16's range: both in float32
        mx::array b(biases, shape, mx::float32, [](void* p) { delete[] static_cast<float*>(p); });
        return nb::make_tuple(w, mx::astype(s, mx::float32), b, bits);
      },
      "data"_a, "type"_a, "rows"_a, "d_in"_a,
      "Q4_0 / Q4_1 / Q8_0 blocks (GGMLQuantizationType 2, 3, 8) of a (rows, d_in) matrix -> (w, scales, biases, "
      "bits), MLX's affine layout with group 32 as MLX arrays, threaded: GGML's values exactly; scales and biases "
      "float16 where every bias is a float16 value, else float32");
  m.def("dequantizes", &mlxtoy::dequantizes, "type"_a, "whether dequantize reads this GGMLQuantizationType");
  m.def(
      "dequantize",
      [](nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> data, int type, int64_t n_values) {
        auto* out = new float[static_cast<size_t>(n_values)];
        nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<float*>(p); });
        {
          nb::gil_scoped_release unlocked;
          try {
            mlxtoy::dequantize(data.data(), static_cast<int64_t>(data.shape(0)), type, out, n_values);
          } catch (...) {
            nb::gil_scoped_acquire locked;
            throw;
          }
        }
        size_t shape[1] = {static_cast<size_t>(n_values)};
        return nb::ndarray<nb::numpy, float, nb::ndim<1>>(out, 1, shape, owner);
      },
      "data"_a, "type"_a, "n_values"_a,
      "GGUF blocks (uint8, C-contiguous) of GGMLQuantizationType type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, "
      "Q6_K) -> float32 (n_values,), the values gguf-py's dequantize gives, threaded; a plain function on numpy arrays");
  m.def("sum_squares", &mlxtoy::sum_squares, "x"_a, nb::kw_only(), "stream"_a = nb::none(),
        "sum(x^2) as float32 (1,), summed in double over fixed blocks: the same bits on any thread count");
  m.def("logsumexp", &mlxtoy::logsumexp, "x"_a, nb::kw_only(), "stream"_a = nb::none(),
        "log(sum(exp(x))) over the last axis -> x.shape[:-1] ((1,) for a vector): the polynomial exp, "
        "summed in double over fixed blocks of each row, threaded; no gradient");
  m.def("argmax", &mlxtoy::argmax, "x"_a, nb::kw_only(), "stream"_a = nb::none(),
        "the index of the largest entry of each row (the last axis), the first of equal ones, as uint32 "
        "-> x.shape[:-1] ((1,) for a vector); NaN entries are never taken; threaded over rows; no gradient");
  m.def("pack", &mlxtoy::pack, "w"_a, "form"_a, nb::kw_only(), "stream"_a = nb::none(),
        "w (..., K) float32 -> (packed uint8, ok (1,) int32): each block of 32 weights along K in form q4: "
        "float32 d and m then 16 bytes (weight j in the low nibble of byte j, j + 16 in the high one), "
        "w = d * q + m (24 bytes); q5: the same, then uint32 qh holding each weight's fifth bit (bit j: "
        "weight j), q in 0..31 (28 bytes); q8: float32 d of weights 0..15 and of 16..31, then 32 int8, "
        "w = d * q (40 bytes); q4_0: float16 d, then 16 bytes as q4's, w = d * (q - 8) (18 bytes, Q4_0's "
        "block); q8_0: float16 d, then 32 int8, w = d * q (34 bytes, Q8_0's block). ok 1 where every weight "
        "is exactly that (as a Q4_0, Q4_1, Q4_K, Q5_1, Q5_K, Q5_0, Q6_K or Q8_0 GGUF dequantizes), 0 where "
        "some is not (the packing is then of no use)");
  m.def("gemv_packed", &mlxtoy::gemv_packed, "x"_a, "packed"_a, nb::kw_only(), "stream"_a = nb::none(),
        "x @ w.T for a few rows of x and w packed by pack (the width says the form), threaded; no gradient");
  m.def("packed_row_pass", &mlxtoy::packed_row_pass, "form"_a,
        "the rows of a packed W in this form (pack's) that gemv_packed and decode_block take a pass for one row "
        "of x: set_packed_row_pass's, else the built-in choice; 0 where packs are unpacked first (no passes)");
  m.def("set_packed_row_pass", &mlxtoy::set_packed_row_pass, "form"_a, "rows"_a,
        "the rows of a packed W in this form one row of x takes a pass from now on, in this process: 1, 2, 4 or 8 "
        "(0: the built-in choice); the same bits whichever (each row's sum is its own chain)");
  m.def("adamw", &mlxtoy::adamw, "p"_a, "g"_a, "m"_a, "v"_a, "scalars"_a, nb::kw_only(), "stream"_a = nb::none(),
        "one AdamW step (no bias correction) on g * grad_scale -> (p, m, v), in one pass; scalars float32 "
        "[lr, ok, b1, 1 - b1, b2, 1 - b2, eps, weight_decay, grad_scale]: where ok is 0 the old p, m, v "
        "come back");
  m.def("rope", &mlxtoy::rope, "x"_a, "offset"_a, "inv_freqs"_a, "dims"_a, "traditional"_a, "scale"_a, nb::kw_only(),
        "stream"_a = nb::none(),
        "mx.fast.rope's forward for x (B, N, T, D) (any layout): position offset + t (offset one int32), "
        "angle position * scale * inv_freqs[i] on the pair (i, i + dims / 2), or (2i, 2i + 1) if traditional");
  m.def("decode_block", &mlxtoy::decode_block, "x"_a, "weights"_a, "biases"_a, "keys"_a, "values"_a, "offset"_a,
        "inv_freqs"_a, "rope_dims"_a, "traditional"_a, "eps"_a, "attn_scale"_a, "rope_scale"_a, nb::kw_only(),
        "starts"_a = nb::none(), "affine"_a = std::vector<mx::array>{}, "symmetric"_a = 0,
        "low_rank"_a = std::vector<mx::array>{}, "low_rank_of"_a = 0, "dora_of"_a = 0, "ids"_a = nb::none(), "stream"_a = nb::none(),
        "one pre-norm Llama block for T new tokens of each of B rows -> (x, keys, values): x (B, T, D); weights "
        "[attn_norm, q (H, Dh, D), k (KV, Dh, D), v, o (D, H * Dh), ffn_norm, gate (F, D), up, down (D, F)]; biases "
        "[] or [q (H, Dh), k, v]; keys/values (B, KV, S, Dh) get token t's k (RoPE'd) and v at slot offset + t "
        "(offset one int32) and its query attends to slots starts[b]..offset + t (starts (B,) int32, zeros when "
        "None; a slot before starts[b] sees itself only), its position offset + t - starts[b]; RoPE as the rope "
        "kernel's; a matrix may be MLX's affine 4-bit layout (uint32 words, groups of 32), its scales and biases "
        "then next in affine (symmetric: bit i set where weights[i]'s biases are -8 scales), multiplied by the "
        "integer forms as quant_linear's GEMV; low_rank [A (S, r, in), B (S, out, r), ...] for each matrix "
        "weights[i] with bit i of low_rank_of set, in order (and k (S, out) after them where bit i of dora_of is "
        "set): each row's product gets B[s] (A[s] v) added (then times k[s], DoRA's rescale; then a bias; "
        "before RoPE), s = ids[b] (ids (B,) int32; every row slot 0 when None); the caches are updated in place "
        "when donated");
}
