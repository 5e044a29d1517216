// mlxtoy's CPU kernels: the float32 row-wise work that MLX's CPU backend runs unfused and on
// one thread (softmax, cross-entropy, RMSNorm, SwiGLU) and the small-batch GEMV of decoding
// (which MKL runs on one thread), the one-query attention of decoding, AdamW's update, a
// logsumexp, the lossless 4/8-bit packing of weights for decoding with its GEMV, and a GEMM on
// AVX-512 CPUs (gemm.h: training's and prefill's products of many rows). Each is an
// MLX primitive evaluated on the CPU stream; rows are split over a small thread pool (pool.h),
// the loops are in loops.h (packed weights in packed.h), the fused decode block in decode.cpp.
// Gradients are wired up in Python (mx.custom_function).

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "kernels.h"
#include "copy.h"   // strided inputs made contiguous
#include "attend.h"  // one query position's attention
#include "gemm.h"   // the AVX-512 GEMM
#include "gemv.h"   // the float32 GEMV
#include "loops.h"  // the float32 loops
#include "packed.h"  // lossless 4/8-bit weights
#include "pool.h"   // the threads they are split over

namespace mlxtoy {

// ---- the primitive --------------------------------------------------------------------------

int kernel_threads() { return pool().threads(); }

bool kernel_openmp() { return pool().openmp(); }

const char* kernel_forms() {
#ifdef MLXTOY_AVX2
  if (cpu_avx512()) return "avx512";
  if (cpu_avx2_fma()) return "avx2";
#endif
  return "portable";
}

void Kernel::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlxtoy_kernels] CPU kernels only");
}

bool Kernel::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const Kernel&>(other);
  return op_ == o.op_ && param_ == o.param_ && iparam_ == o.iparam_;
}


void Kernel::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  for (size_t i = 0; i < outputs.size(); ++i) {
    auto& out = outputs[i];
    // AdamW's p, m and v (inputs 0, 2, 3) are updated in place when no one else holds them
    int donor = op_ != Op::AdamW ? -1 : (i == 0 ? 0 : static_cast<int>(i) + 1);
    if (donor >= 0 && inputs[donor].is_donatable() && inputs[donor].flags().row_contiguous)
      out.copy_shared_buffer(inputs[donor]);
    else
      out.set_data(mx::allocator::malloc(out.nbytes()));
  }
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (auto& in : inputs) encoder.set_input_array(in);
  for (auto& out : outputs) encoder.set_output_array(out);

  std::vector<const void*> in;
  std::vector<void*> out;
  std::vector<StridedCopy> copies;
  std::vector<mx::array> temps;  // the copies' buffers, held by the task
  // RoPE reads x's rows through x's strides where the rows have unit stride (else a copy)
  const bool rope_strided = op_ == Op::Rope && inputs[0].strides().back() == 1;
  for (size_t i = 0; i < inputs.size(); ++i)
    in.push_back(task_data(inputs[i], inputs[i].flags().row_contiguous || (i == 0 && rope_strided), copies, temps));
  for (auto& a : outputs) out.push_back(a.data<void>());
  const mx::Shape& shape0 = inputs[0].shape();
  int64_t last = shape0.back();
  int64_t rows = inputs[0].size() / std::max<int64_t>(last, 1);
  Op op = op_;
  float eps = param_;
  // Softmax: s (..., T, S), bias (Bb, T, S) with Bb 1 (rows_per_bias 0) or s's leading dim
  int64_t T = op == Op::Softmax ? inputs[1].shape(-2) : 0;
  int64_t rows_per_bias = op == Op::Softmax && inputs[1].shape(0) != 1 ? rows / inputs[1].shape(0) : 0;
  // GemvMany: each w_i's rows (all its axes but the last, flattened); GemvPacked: its matrix's rows
  std::vector<int64_t> Ns;
  if (op == Op::GemvPacked) Ns.push_back(inputs[1].shape(0));
  if (op == Op::GemvMany || op == Op::GemmMany)
    for (size_t i = 1; i < inputs.size(); ++i) Ns.push_back(inputs[i].size() / std::max<int64_t>(last, 1));
  // DecodeAttention: q (B, H, 1, D), k (B, KV, S, D), v (B, KV, S, Dv), bias (Bb, S)
  std::array<int64_t, 6> att{};  // B, H, KV, S, Dv, Bb
  if (op == Op::DecodeAttention)
    att = {inputs[0].shape(0), inputs[0].shape(1), inputs[1].shape(1), inputs[1].shape(2), inputs[2].shape(3),
           inputs[3].shape(0)};

  // Rope: x (B, N, T, D); iparam 2 * dims + traditional
  std::array<int64_t, 7> rope{};  // N, T, the strides of B, N, T as read; dims; traditional
  if (op == Op::Rope) {
    const mx::array& x = inputs[0];
    int64_t N = x.shape(1), Tn = x.shape(2);
    mx::Strides xs = rope_strided ? x.strides() : mx::Strides{N * Tn * last, Tn * last, last};  // else the copy
    rope = {N, Tn, xs[0], xs[1], xs[2], iparam_ / 2, iparam_ % 2};
  }

  const int bits = iparam_;  // Pack, GemvPacked; Gemm's transpositions
  // Gemm: op(a) (M, S), op(b) (S, N)
  std::array<int64_t, 3> mkn{};
  if (op == Op::Gemm) {
    bool ta = bits & 1;
    mkn = {inputs[0].shape(ta ? 1 : 0), inputs[0].shape(ta ? 0 : 1), inputs[1].shape((bits & 2) ? 0 : 1)};
  }
  encoder.dispatch([op, eps, bits, in, out, rows, last, T, rows_per_bias, Ns, att, rope, mkn, copies = std::move(copies),
                    temps = std::move(temps)]() {
    for (const auto& c : copies) c.run();
    Pool& threads = pool();
    switch (op) {
      case Op::Rope: {
        auto [N, Tn, sb, sn, st, dims, traditional] = rope;
        auto x = static_cast<const float*>(in[0]);
        int32_t offset = static_cast<const int32_t*>(in[1])[0];
        auto inv_freqs = static_cast<const float*>(in[2]);
        auto y = static_cast<float*>(out[0]);
        float scale = eps;
        threads.run(rows, grain(last), [&](int64_t r0, int64_t r1) {
          for (int64_t r = r0; r < r1; ++r) {
            int64_t b = r / (N * Tn), n = (r / Tn) % N, t = r % Tn;
            // positions as mx.fast.rope forms them: (t + offset) in float32, times the scale
            float pos = (static_cast<float>(t) + static_cast<float>(offset)) * scale;
            rope_row(x + b * sb + n * sn + t * st, y + r * last, last, dims, traditional != 0, pos, inv_freqs);
          }
        });
        break;
      }
      case Op::Softmax: {
        auto s = static_cast<const float*>(in[0]);
        auto bias = static_cast<const float*>(in[1]);
        auto p = static_cast<float*>(out[0]);
        threads.run(rows, grain(last), [&](int64_t r0, int64_t r1) {
          for (int64_t r = r0; r < r1; ++r) {
            int64_t b = rows_per_bias ? r / rows_per_bias : 0;
            const float* row_bias = bias + (b * T + r % T) * last;
            softmax_row(s + r * last, row_bias, p + r * last, last, open_length(row_bias, last));
          }
        });
        break;
      }
      case Op::SoftmaxGrad: {
        auto p = static_cast<const float*>(in[0]);
        auto dp = static_cast<const float*>(in[1]);
        auto ds = static_cast<float*>(out[0]);
        threads.run(rows, grain(last), [&](int64_t r0, int64_t r1) {
          for (int64_t r = r0; r < r1; ++r) {
            int64_t len = last;  // p's zero tail (a masked one) skipped
            while (len > 0 && p[r * last + len - 1] == 0.0f) --len;
            softmax_grad_row(p + r * last, dp + r * last, ds + r * last, last, len);
          }
        });
        break;
      }
      case Op::CrossEntropyColumns:
      case Op::CrossEntropyColumnsGrad: {
        auto x = static_cast<const float*>(in[0]);
        auto t = static_cast<const int32_t*>(in[1]);
        auto ce = static_cast<float*>(out[0]);
        float* d = op == Op::CrossEntropyColumnsGrad ? static_cast<float*>(out[1]) : nullptr;
        int64_t V = rows, C = last;
        threads.run(C, 16, [&](int64_t c0, int64_t c1) { cross_entropy_columns(x, t, ce, d, V, C, c0, c1); });
        break;
      }
      case Op::RmsNorm: {
        auto x = static_cast<const float*>(in[0]);
        auto w = static_cast<const float*>(in[1]);
        auto y = static_cast<float*>(out[0]);
        threads.run(rows, grain(last), [&](int64_t r0, int64_t r1) {
          for (int64_t r = r0; r < r1; ++r) rms_norm_row(x + r * last, w, y + r * last, last, eps);
        });
        break;
      }
      case Op::RmsNormGrad: {
        auto x = static_cast<const float*>(in[0]);
        auto w = static_cast<const float*>(in[1]);
        auto g = static_cast<const float*>(in[2]);
        auto dx = static_cast<float*>(out[0]);
        auto dw = static_cast<float*>(out[1]);
        // each slice sums its rows' dw into its own buffer; the buffers are added in order
        std::vector<float> partial(static_cast<size_t>(threads.threads()) * last, 0.0f);
        threads.run_parts(rows, grain(last), [&](int part, int64_t r0, int64_t r1) {
          float* acc = partial.data() + static_cast<size_t>(part) * last;
          for (int64_t r = r0; r < r1; ++r)
            rms_norm_grad_row(x + r * last, w, g + r * last, dx + r * last, acc, last, eps);
        });
        std::fill(dw, dw + last, 0.0f);
        for (int part = 0; part < threads.threads(); ++part)
          for (int64_t j = 0; j < last; ++j) dw[j] += partial[static_cast<size_t>(part) * last + j];
        break;
      }
      case Op::Swiglu: {
        auto a = static_cast<const float*>(in[0]);
        auto b = static_cast<const float*>(in[1]);
        auto y = static_cast<float*>(out[0]);
        threads.run(rows * last, 1 << 14, [&](int64_t i0, int64_t i1) {
          swiglu_span(a + i0, b + i0, y + i0, i1 - i0);
        });
        break;
      }
      case Op::SwigluGrad: {
        auto a = static_cast<const float*>(in[0]);
        auto b = static_cast<const float*>(in[1]);
        auto g = static_cast<const float*>(in[2]);
        auto da = static_cast<float*>(out[0]);
        auto db = static_cast<float*>(out[1]);
        threads.run(rows * last, 1 << 14, [&](int64_t i0, int64_t i1) {
          swiglu_grad_span(a + i0, b + i0, g + i0, da + i0, db + i0, i1 - i0);
        });
        break;
      }
      case Op::GemvMany: {
        // the weights' rows as one range [0, sum N_i), split once over the threads
        auto x = static_cast<const float*>(in[0]);
        int64_t total = 0;
        for (int64_t n : Ns) total += n;
        threads.run_dynamic(total, gemv_chunk(total, threads.threads()), [&](int64_t r0, int64_t r1) {
          int64_t first = 0;
          for (size_t i = 0; i < Ns.size(); ++i) {
            int64_t lo = std::max(r0 - first, int64_t{0}), hi = std::min(r1 - first, Ns[i]);
            if (lo < hi)
              gemv_span(x, static_cast<const float*>(in[i + 1]), static_cast<float*>(out[i]), rows, Ns[i], last, lo, hi,
                        true);
            first += Ns[i];
          }
        });
        break;
      }
      case Op::GemmMany: {
        // x (rows, K) against every weight (N_i, K): out_i (rows, N_i)
        std::vector<GemmTarget> targets;
        for (size_t i = 0; i < Ns.size(); ++i)
          targets.push_back({{static_cast<const float*>(in[i + 1]), last, 1}, Ns[i], static_cast<float*>(out[i]), Ns[i], 1});
        gemm_run(threads, {static_cast<const float*>(in[0]), last, 1}, rows, last, targets);
        break;
      }
      case Op::Gemm: {
        // op(a) (M, S) @ op(b) (S, N), written (M, N), or (N, M) with trans_out
        auto [M, S, N] = mkn;
        bool ta = bits & 1, tb = bits & 2, to = bits & 4;
        GemmOperand a{static_cast<const float*>(in[0]), ta ? 1 : S, ta ? M : 1};
        GemmOperand b{static_cast<const float*>(in[1]), tb ? S : 1, tb ? 1 : N};
        auto y = static_cast<float*>(out[0]);
        gemm_run(threads, a, M, S, {{b, N, y, to ? 1 : N, to ? M : 1}});
        break;
      }
      case Op::SumSquares: {
        auto x = static_cast<const float*>(in[0]);
        int64_t n = rows * last, blocks = (n + kSumBlock - 1) / kSumBlock;
        std::vector<double> partial(static_cast<size_t>(std::max<int64_t>(blocks, 1)), 0.0);
        threads.run(blocks, 4, [&](int64_t b0, int64_t b1) {
          for (int64_t b = b0; b < b1; ++b)
            partial[b] = sum_squares_span(x + b * kSumBlock, std::min(kSumBlock, n - b * kSumBlock));
        });
        double total = 0.0;
        for (double v : partial) total += v;
        static_cast<float*>(out[0])[0] = static_cast<float>(total);
        break;
      }
      case Op::LogSumExp: {
        // each row in fixed blocks (the same bits on any thread count), combined in order
        auto x = static_cast<const float*>(in[0]);
        auto y = static_cast<float*>(out[0]);
        int64_t per_row = (last + kLseBlock - 1) / kLseBlock, blocks = rows * per_row;
        std::vector<float> bm(blocks);
        std::vector<double> bs(blocks);
        threads.run(blocks, 2, [&](int64_t b0, int64_t b1) {
          for (int64_t b = b0; b < b1; ++b) {
            int64_t r = b / per_row, j = (b % per_row) * kLseBlock;
            lse_block(x + r * last + j, std::min(kLseBlock, last - j), &bm[b], &bs[b]);
          }
        });
        for (int64_t r = 0; r < rows; ++r) {
          float m = kNegInf;
          for (int64_t b = r * per_row; b < (r + 1) * per_row; ++b) m = std::max(m, bm[b]);
          double s = 0.0;
          if (std::isfinite(m))
            for (int64_t b = r * per_row; b < (r + 1) * per_row; ++b)
              if (bs[b] > 0.0) s += bs[b] * static_cast<double>(poly_exp(bm[b] - m, exp_range()));
          y[r] = std::isfinite(m) ? m + static_cast<float>(std::log(s)) : m;  // all -inf: -inf; +inf, NaN: as given
        }
        break;
      }
      case Op::ArgMax: {
        auto x = static_cast<const float*>(in[0]);
        auto y = static_cast<uint32_t*>(out[0]);
        threads.run(rows, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(last, 1)), [&](int64_t r0, int64_t r1) {
          for (int64_t r = r0; r < r1; ++r) y[r] = static_cast<uint32_t>(argmax_row(x + r * last, last));
        });
        break;
      }
      case Op::Pack: {
        auto w = static_cast<const float*>(in[0]);
        std::atomic<bool> lossless{true};
        threads.run(rows, 16, [&](int64_t r0, int64_t r1) {
          for (int64_t r = r0; r < r1 && lossless.load(std::memory_order_relaxed); ++r) {
            const int64_t at = r * (last / kQ4);
            bool ok = false;
            with_pack(static_cast<Pack>(bits), [&]<Pack P>() {
              ok = pack_row<P>(w + r * last, last, static_cast<char*>(out[0]) + at * pack_block_bytes(P));
            });
            if (!ok) lossless = false;
          }
        });
        static_cast<int32_t*>(out[1])[0] = lossless ? 1 : 0;
        break;
      }
      case Op::GemvPacked: {
        // x (rows, K); the packed matrix's rows split first come, first served, each sum the
        // float32 GEMV's over the weights it was packed from (Matrix::gemv_rows); where the
        // blocks are unpacked, a few rows of W at a time (they stay in cache)
        auto x = static_cast<const float*>(in[0]);
        auto y = static_cast<float*>(out[0]);
        int64_t N = Ns[0];
        const Matrix w{nullptr, in[1], static_cast<Pack>(bits), last};
        threads.run_dynamic(N, gemv_chunk(N, threads.threads()), [&](int64_t n0, int64_t n1) {
          constexpr int64_t kUnpacked = 64;
          std::vector<float> unpacked(Matrix::unpacks(rows) ? kUnpacked * last : 0);
          for (int64_t a = n0; a < n1; a += kUnpacked)
            w.rows(a).gemv_rows(x, rows, y + a, N, std::min(n1, a + kUnpacked) - a, unpacked.data());
        });
        break;
      }
      case Op::AdamW: {
        auto p = static_cast<const float*>(in[0]);
        auto g = static_cast<const float*>(in[1]);
        auto m = static_cast<const float*>(in[2]);
        auto v = static_cast<const float*>(in[3]);
        auto sc = static_cast<const float*>(in[4]);
        auto po = static_cast<float*>(out[0]);
        auto mo = static_cast<float*>(out[1]);
        auto vo = static_cast<float*>(out[2]);
        threads.run(rows * last, 1 << 15, [&](int64_t i0, int64_t i1) {
          adamw_span(p + i0, g + i0, m + i0, v + i0, po + i0, mo + i0, vo + i0, i1 - i0, sc);
        });
        break;
      }
      case Op::DecodeAttention: {
        auto [B, H, KV, S, Dv, Bb] = att;
        int64_t D = last, group = H / KV;
        auto q = static_cast<const float*>(in[0]);
        auto k = static_cast<const float*>(in[1]);
        auto v = static_cast<const float*>(in[2]);
        auto bias = static_cast<const float*>(in[3]);
        auto o = static_cast<float*>(out[0]);
        float scale = eps;
        // each (b, KV head)'s query heads against its open positions (keys past the bias's last
        // unmasked one are not read) in parts, then each query row's parts combined (attend.h)
        const int64_t parts = attend_parts(S);
        const AttendPartials at{group, parts, attend_partial_floats(Dv)};  // (b, KV head) pairs as the KV heads
        std::vector<int64_t> lens(B);
        for (int64_t b = 0; b < B; ++b) lens[b] = open_length(bias + (Bb == 1 ? 0 : b) * S, S);
        std::vector<float> partials(static_cast<size_t>(at.floats(B * KV)));
        threads.run_dynamic(B * KV * parts, 1, [&](int64_t u0, int64_t u1) {
          std::vector<float> scores(static_cast<size_t>(group * kAttendPart));
          for (int64_t u = u0; u < u1; ++u) {
            const int64_t bk = u / parts, b = bk / KV, j0 = (u % parts) * kAttendPart;
            if (j0 >= lens[b] && j0 > 0) continue;  // past the open positions (part 0 always runs)
            attend_part(q + bk * group * D, group, k + bk * S * D, v + bk * S * Dv, bias + (Bb == 1 ? 0 : b) * S, j0,
                        std::min(lens[b], j0 + kAttendPart), D, Dv, scale, scores.data(),
                        partials.data() + at.part(bk, u % parts));
          }
        });
        threads.run(B * H, 16, [&](int64_t r0, int64_t r1) {
          for (int64_t r = r0; r < r1; ++r) {
            attend_combine(partials.data() + at.head(r), attend_parts(lens[r / H]), at.stride(), Dv, o + r * Dv);
          }
        });
        break;
      }
    }
  });
}

// ---- ops ------------------------------------------------------------------------------------

namespace {

mx::array f32(const mx::array& a, const char* what) {
  if (a.dtype() != mx::float32) throw std::invalid_argument(std::string("[mlxtoy_kernels] ") + what + " must be float32");
  return a;  // any layout: eval_cpu copies a strided view itself
}

std::vector<mx::array> make(Kernel::Op op, float eps, std::vector<mx::Shape> shapes,
                            std::vector<mx::Dtype> dtypes, std::vector<mx::array> inputs,
                            mx::StreamOrDevice s, int iparam = 0) {
  for (auto& a : inputs)
    if (a.ndim() == 0) throw std::invalid_argument("[mlxtoy_kernels] inputs must have at least one axis");
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) throw std::invalid_argument("[mlxtoy_kernels] CPU stream only");
  return mx::array::make_arrays(std::move(shapes), std::move(dtypes),
                                std::make_shared<Kernel>(stream, op, eps, iparam), std::move(inputs));
}

void same_shape(const mx::array& a, const mx::array& b, const char* what) {
  if (a.shape() != b.shape()) throw std::invalid_argument(std::string("[mlxtoy_kernels] ") + what + ": shapes differ");
}

}  // namespace

mx::array softmax_bias(const mx::array& s, const mx::array& bias, mx::StreamOrDevice st) {
  if (s.ndim() < 3 || bias.ndim() != 3 || bias.shape(-1) != s.shape(-1) || bias.shape(-2) != s.shape(-2))
    throw std::invalid_argument("[mlxtoy_kernels] softmax_bias: s (B, ..., T, S) and bias (1|B, T, S)");
  if (bias.shape(0) != 1 && bias.shape(0) != s.shape(0))
    throw std::invalid_argument("[mlxtoy_kernels] softmax_bias: bias batch must be 1 or s's");
  return make(Kernel::Op::Softmax, 0, {s.shape()}, {mx::float32}, {f32(s, "s"), f32(bias, "bias")}, st)[0];
}

mx::array softmax_grad(const mx::array& p, const mx::array& dp, mx::StreamOrDevice st) {
  same_shape(p, dp, "softmax_grad");
  return make(Kernel::Op::SoftmaxGrad, 0, {p.shape()}, {mx::float32}, {f32(p, "p"), f32(dp, "dp")}, st)[0];
}

std::vector<mx::array> cross_entropy_columns(const mx::array& logits_t, const mx::array& targets, bool grad,
                                             mx::StreamOrDevice st) {
  if (logits_t.ndim() != 2 || targets.ndim() != 1 || targets.shape(0) != logits_t.shape(1))
    throw std::invalid_argument("[mlxtoy_kernels] cross_entropy_columns: logits (V, N), targets (N,)");
  auto t = mx::contiguous(mx::astype(targets, mx::int32, st), false, st);
  mx::Shape n{logits_t.shape(1)};
  if (grad)
    return make(Kernel::Op::CrossEntropyColumnsGrad, 0, {n, logits_t.shape()}, {mx::float32, mx::float32},
                {f32(logits_t, "logits"), t}, st);
  return make(Kernel::Op::CrossEntropyColumns, 0, {n}, {mx::float32}, {f32(logits_t, "logits"), t}, st);
}

mx::array rms_norm(const mx::array& x, const mx::array& w, float eps, mx::StreamOrDevice st) {
  if (x.ndim() == 0 || w.ndim() != 1 || w.shape(0) != x.shape(-1))
    throw std::invalid_argument("[mlxtoy_kernels] rms_norm: x (..., D), w (D,)");
  return make(Kernel::Op::RmsNorm, eps, {x.shape()}, {mx::float32}, {f32(x, "x"), f32(w, "w")}, st)[0];
}

std::vector<mx::array> rms_norm_grad(const mx::array& x, const mx::array& w, const mx::array& g, float eps,
                                     mx::StreamOrDevice st) {
  same_shape(x, g, "rms_norm_grad");
  if (x.ndim() == 0 || w.ndim() != 1 || w.shape(0) != x.shape(-1))
    throw std::invalid_argument("[mlxtoy_kernels] rms_norm_grad: x (..., D), w (D,)");
  return make(Kernel::Op::RmsNormGrad, eps, {x.shape(), w.shape()}, {mx::float32, mx::float32},
              {f32(x, "x"), f32(w, "w"), f32(g, "g")}, st);
}

mx::array swiglu(const mx::array& a, const mx::array& b, mx::StreamOrDevice st) {
  same_shape(a, b, "swiglu");
  return make(Kernel::Op::Swiglu, 0, {a.shape()}, {mx::float32}, {f32(a, "a"), f32(b, "b")}, st)[0];
}

std::vector<mx::array> swiglu_grad(const mx::array& a, const mx::array& b, const mx::array& g,
                                   mx::StreamOrDevice st) {
  same_shape(a, b, "swiglu_grad");
  same_shape(a, g, "swiglu_grad");
  return make(Kernel::Op::SwigluGrad, 0, {a.shape(), a.shape()}, {mx::float32, mx::float32},
              {f32(a, "a"), f32(b, "b"), f32(g, "g")}, st);
}

namespace {

// [x @ w.T for w in ws] as one primitive of `op` (GemvMany, GemmMany): the checks and shapes
std::vector<mx::array> many_products(Kernel::Op op, const char* name, const mx::array& x,
                                     const std::vector<mx::array>& ws, mx::StreamOrDevice st) {
  const std::string usage = std::string("[mlxtoy_kernels] ") + name + ": x (..., K), ws [(..., K), ...]";
  if (x.ndim() == 0 || ws.empty()) throw std::invalid_argument(usage);
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  std::vector<mx::array> inputs{f32(x, "x")};
  for (auto& w : ws) {
    if (w.ndim() < 2 || w.shape(-1) != x.shape(-1)) throw std::invalid_argument(usage);
    // x's leading axes, then w's: a per-head weight (H, Dh, K) gives (..., H, Dh)
    mx::Shape out(x.shape().begin(), x.shape().end() - 1);
    out.insert(out.end(), w.shape().begin(), w.shape().end() - 1);
    shapes.push_back(out);
    dtypes.push_back(mx::float32);
    inputs.push_back(f32(w, "w"));
  }
  return make(op, 0, shapes, dtypes, inputs, st);
}

}  // namespace

std::vector<mx::array> gemv_many(const mx::array& x, const std::vector<mx::array>& ws, mx::StreamOrDevice st) {
  return many_products(Kernel::Op::GemvMany, "gemv_many", x, ws, st);
}

bool gemm_ok() { return gemm_x86(); }

std::vector<mx::array> gemm_many(const mx::array& x, const std::vector<mx::array>& ws, mx::StreamOrDevice st) {
  if (!gemm_x86()) throw std::runtime_error("[mlxtoy_kernels] gemm_many needs a CPU with AVX-512, or AVX2 and FMA");
  return many_products(Kernel::Op::GemmMany, "gemm_many", x, ws, st);
}

mx::array gemm(const mx::array& a, const mx::array& b, bool trans_a, bool trans_b, bool trans_out,
               mx::StreamOrDevice st) {
  if (!gemm_x86()) throw std::runtime_error("[mlxtoy_kernels] gemm needs a CPU with AVX-512, or AVX2 and FMA");
  if (a.ndim() != 2 || b.ndim() != 2 || a.shape(trans_a ? 0 : 1) != b.shape(trans_b ? 1 : 0))
    throw std::invalid_argument("[mlxtoy_kernels] gemm: op(a) (M, S) and op(b) (S, N), 2-D");
  int M = a.shape(trans_a ? 1 : 0), N = b.shape(trans_b ? 0 : 1);
  mx::Shape out = trans_out ? mx::Shape{N, M} : mx::Shape{M, N};
  int flags = (trans_a ? 1 : 0) | (trans_b ? 2 : 0) | (trans_out ? 4 : 0);
  return make(Kernel::Op::Gemm, 0, {out}, {mx::float32}, {f32(a, "a"), f32(b, "b")}, st, flags)[0];
}

mx::array gemv(const mx::array& x, const mx::array& w, mx::StreamOrDevice st) {
  if (x.ndim() == 0 || w.ndim() != 2 || x.shape(-1) != w.shape(1))
    throw std::invalid_argument("[mlxtoy_kernels] gemv: x (..., K), w (N, K)");
  return gemv_many(x, {w}, st)[0];
}

mx::array decode_attention(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& bias,
                           float scale, mx::StreamOrDevice st) {
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4 || bias.ndim() != 2 || q.shape(2) != 1 ||
      k.shape(0) != q.shape(0) || v.shape(0) != q.shape(0) || k.shape(3) != q.shape(3) ||
      v.shape(1) != k.shape(1) || v.shape(2) != k.shape(2) || k.shape(1) == 0 || q.shape(1) % k.shape(1) != 0 ||
      bias.shape(1) != k.shape(2) || (bias.shape(0) != 1 && bias.shape(0) != q.shape(0)))
    throw std::invalid_argument(
        "[mlxtoy_kernels] decode_attention: q (B, H, 1, D), k (B, KV, S, D), v (B, KV, S, Dv), bias (1|B, S), "
        "H a multiple of KV");
  mx::Shape out{q.shape(0), q.shape(1), 1, v.shape(3)};
  return make(Kernel::Op::DecodeAttention, scale, {out}, {mx::float32},
              {f32(q, "q"), f32(k, "k"), f32(v, "v"), f32(bias, "bias")}, st)[0];
}

mx::array sum_squares(const mx::array& x, mx::StreamOrDevice st) {
  if (x.size() == 0) throw std::invalid_argument("[mlxtoy_kernels] sum_squares: x is empty");
  auto flat = f32(mx::reshape(x, {static_cast<int>(x.size()), 1}, st), "x");
  return make(Kernel::Op::SumSquares, 0, {{1}}, {mx::float32}, {flat}, st)[0];
}

std::vector<mx::array> pack(const mx::array& w, const std::string& form, mx::StreamOrDevice st) {
  const Pack p = pack_named(form);
  if (w.ndim() < 2 || w.shape(-1) % kQ4 != 0 || p == Pack::none)
    throw std::invalid_argument("[mlxtoy_kernels] pack: w (..., K), K a multiple of 32, form q4, q5, q8, q4_0 or q8_0");
  mx::Shape packed(w.shape().begin(), w.shape().end() - 1);
  packed.push_back(static_cast<int>(packed_width(w.shape(-1), p)));
  return make(Kernel::Op::Pack, 0, {packed, {1}}, {mx::uint8, mx::int32}, {f32(w, "w")}, st, static_cast<int>(p));
}

int packed_row_pass(const std::string& form) {
  const Pack p = pack_named(form);
  if (p == Pack::none) throw std::invalid_argument("[mlxtoy_kernels] packed_row_pass: form q4, q5, q8, q4_0 or q8_0");
  int rows = 0;  // (the portable build and a CPU without AVX2 and FMA unpack: no passes)
#ifdef MLXTOY_AVX2
  if (!Matrix::unpacks(1)) {
    const int set = packed_row_pass_set[static_cast<int>(p)].load();
    with_pack(p, [&]<Pack P>() {
      rows = set ? set : cpu_avx512() ? packed_row_pass_built_in<P, true>() : packed_row_pass_built_in<P, false>();
    });
  }
#endif
  return rows;
}

void set_packed_row_pass(const std::string& form, int rows) {
  const Pack p = pack_named(form);
  if (p == Pack::none || (rows != 0 && rows != 1 && rows != 2 && rows != 4 && rows != 8))
    throw std::invalid_argument("[mlxtoy_kernels] set_packed_row_pass: form q4, q5, q8, q4_0 or q8_0; rows 1, 2, 4, 8 "
                                "(0: the built-in choice)");
  packed_row_pass_set[static_cast<int>(p)].store(rows);
}

mx::array gemv_packed(const mx::array& x, const mx::array& packed, mx::StreamOrDevice st) {
  const char* usage = "[mlxtoy_kernels] gemv_packed: x (..., K), packed (N, K / 32 * 18, 24, 28, 34 or 40) uint8";
  if (x.ndim() == 0 || packed.ndim() != 2 || packed.dtype() != mx::uint8) throw std::invalid_argument(usage);
  int64_t K = x.shape(-1);
  const int bits = static_cast<int>(pack_of_width(K, packed.shape(1)));
  if (bits == 0) throw std::invalid_argument(usage);
  mx::Shape out(x.shape().begin(), x.shape().end() - 1);
  out.push_back(packed.shape(0));
  return make(Kernel::Op::GemvPacked, 0, {out}, {mx::float32}, {f32(x, "x"), packed}, st, bits)[0];
}

mx::array argmax(const mx::array& x, mx::StreamOrDevice st) {
  if (x.ndim() == 0 || x.shape(-1) == 0) throw std::invalid_argument("[mlxtoy_kernels] argmax: x (..., V), V > 0");
  mx::Shape out(x.shape().begin(), x.shape().end() - 1);
  if (out.empty()) out.push_back(1);
  return make(Kernel::Op::ArgMax, 0, {out}, {mx::uint32}, {f32(x, "x")}, st)[0];
}

mx::array logsumexp(const mx::array& x, mx::StreamOrDevice st) {
  if (x.ndim() == 0 || x.shape(-1) == 0) throw std::invalid_argument("[mlxtoy_kernels] logsumexp: x (..., V), V > 0");
  mx::Shape out(x.shape().begin(), x.shape().end() - 1);
  if (out.empty()) out.push_back(1);
  return make(Kernel::Op::LogSumExp, 0, {out}, {mx::float32}, {f32(x, "x")}, st)[0];
}

std::vector<mx::array> adamw(const mx::array& p, const mx::array& g, const mx::array& m, const mx::array& v,
                             const mx::array& scalars, mx::StreamOrDevice st) {
  same_shape(p, g, "adamw");
  same_shape(p, m, "adamw");
  same_shape(p, v, "adamw");
  if (scalars.ndim() != 1 || scalars.shape(0) != 9)
    throw std::invalid_argument(
        "[mlxtoy_kernels] adamw: scalars (9,) [lr, ok, b1, 1 - b1, b2, 1 - b2, eps, wd, grad_scale]");
  int n = static_cast<int>(p.size());
  auto flat = [&](const mx::array& a, const char* what) { return f32(mx::reshape(a, {n, 1}, st), what); };
  auto outs = make(Kernel::Op::AdamW, 0, {{n, 1}, {n, 1}, {n, 1}},
                   {mx::float32, mx::float32, mx::float32},
                   {flat(p, "p"), flat(g, "g"), flat(m, "m"), flat(v, "v"), f32(scalars, "scalars")}, st);
  for (auto& o : outs) o = mx::reshape(o, p.shape(), st);
  return outs;
}

mx::array rope(const mx::array& x, const mx::array& offset, const mx::array& inv_freqs, int dims, bool traditional,
               float scale, mx::StreamOrDevice st) {
  if (x.ndim() != 4 || dims <= 0 || dims % 2 != 0 || dims > x.shape(3))
    throw std::invalid_argument("[mlxtoy_kernels] rope: x (B, N, T, D), dims even and at most D");
  if (inv_freqs.ndim() != 1 || inv_freqs.shape(0) != dims / 2)
    throw std::invalid_argument("[mlxtoy_kernels] rope: inv_freqs (dims / 2,)");
  if (offset.size() != 1 || offset.dtype() != mx::int32)
    throw std::invalid_argument("[mlxtoy_kernels] rope: offset one int32");
  return make(Kernel::Op::Rope, scale, {x.shape()}, {mx::float32},
              {f32(x, "x"), offset, f32(inv_freqs, "inv_freqs")}, st, 2 * dims + (traditional ? 1 : 0))[0];
}

}  // namespace mlxtoy
