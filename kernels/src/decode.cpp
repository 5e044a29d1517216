// One pre-norm Llama block for T new tokens of each of B rows, as one MLX primitive: RMSNorm,
// per-head q/k/v (optional biases), RoPE, token t's k/v written into the cache's slot offset + t,
// GQA attention of token t over its row's columns starts[b]..offset + t (a left-padded batch:
// column c is the row's position c - starts[b]; a padding column, c < starts[b], sees itself
// only), W_o and the residual, RMSNorm, SwiGLU and the residual. T = 1 is a decode step; T > 1
// a short prompt's prefill, which reads each weight once for its T tokens. A token's values are
// the bits it gets decoded alone (B = T = 1, start 0): every product sums each output in the
// chain one row takes (loops.h, packed.h), float32 or packed.
//
// Decoding is bound by memory bandwidth (every weight read once per token), but as ~20 graph
// nodes per layer each node's dispatch and each step's fork-join on the kernels' threads come
// between the GEMVs. Here the block is one task: its phases are split into units (heads, parts of
// the cache, row chunks) handed out first come, first served to the threads that come for the
// job (`Phases`, pool.h), each phase starting once the one before is done. Every value is
// computed by the same loops (loops.h, attend.h) in the same order as the unfused kernels.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "attend.h"
#include "copy.h"
#include "kernels.h"
#include "loops.h"
#include "packed.h"
#include "pool.h"

namespace mlxtoy {

void DecodeBlock::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlxtoy_kernels] CPU kernels only");
}

bool DecodeBlock::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const DecodeBlock&>(other);
  return rope_dims_ == o.rope_dims_ && traditional_ == o.traditional_ && qkv_bias_ == o.qkv_bias_ &&
         low_rank_ == o.low_rank_ &&
         eps_ == o.eps_ && attn_scale_ == o.attn_scale_ && rope_scale_ == o.rope_scale_ && packed_ == o.packed_ &&
         affine_ == o.affine_;
}

namespace {
// inputs: x, the nine weights (attn_norm, q, k, v, o, ffn_norm, gate, up, down), keys, values,
// offset, starts, inv_freqs, then the q/k/v biases if any, then each affine 4-bit matrix's scales
// and biases, in the order of the matrices, then (any low-rank update) the rows' slots and each
// update's A and B (and DoRA's k), in the order of the matrices
enum { kX = 0, kAttnNorm, kQ, kK, kV, kO, kFfnNorm, kGate, kUp, kDown, kKeys, kValues, kOffset, kStarts, kInvFreqs,
       kBiasQ };

HOT float dot_row(const float* a, const float* b, int64_t n) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// An adapter's low-rank update of one matrix's products, added inside the block: a bank's (each
// row reads its own adapter) or a LoRA's or DoRA's around a 4-bit base (merged, it would be a
// float32 copy of that matrix). Row r of slot s gets B[s] (A[s] v_r), A (S, rank, in), B (S, out, rank)
// with the adapter's scale in B; s = ids[r / T], or 0 for every row where S is 1. DoRA: the sum
// then times k[s] (S, out), its rescale m / ||W + scale B A||_row (a constant at inference).
struct LowRank {
  const float* a = nullptr;
  const float* b = nullptr;
  const float* k = nullptr;
  const int32_t* ids = nullptr;
  int64_t slots = 0, rank = 0, in = 0, out = 0, T = 1;

  int64_t slot(int64_t r) const { return slots == 1 ? 0 : ids[r / T]; }
  // t (R, rank): A[s] v_r for each of v's R rows (in floats a row)
  void shrink(const float* v, int64_t R, float* t) const {
    for (int64_t r = 0; r < R; ++r) {
      const float* A = a + slot(r) * rank * in;
      for (int64_t j = 0; j < rank; ++j) t[r * rank + j] = dot_row(A + j * in, v + r * in, in);
    }
  }
  // outputs o0..o1 of each row r, at y[r * N + o - o0], += B[s] row o . t_r (DoRA: then times k[s][o])
  void expand(const float* t, int64_t R, float* y, int64_t N, int64_t o0, int64_t o1) const {
    for (int64_t r = 0; r < R; ++r) {
      const float *Bs = b + slot(r) * out * rank, *ks = k ? k + slot(r) * out : nullptr;
      for (int64_t o = o0; o < o1; ++o) {
        const float v = y[r * N + o - o0] + dot_row(Bs + o * rank, t + r * rank, rank);
        y[r * N + o - o0] = ks ? v * ks[o] : v;
      }
    }
  }
};
}  // namespace

void DecodeBlock::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  std::vector<StridedCopy> copies;
  std::vector<mx::array> temps;
  outputs[0].set_data(mx::allocator::malloc(outputs[0].nbytes()));
  // The caches are written in place, whether or not the graph holds them alone: an output's
  // buffer is held until the task that wrote it finishes (with its siblings', so a multi-output
  // primitive's outputs are never donatable while the next decode step is queued behind it),
  // and a copy of the whole cache per layer per token would cost more than the block. Only
  // slot `offset` is written, which no earlier step reads; the caller keeps no other use of
  // the old arrays (see decode_block). A strided view is copied.
  for (int c = 0; c < 2; ++c) {
    const mx::array& in = inputs[kKeys + c];
    mx::array& out = outputs[1 + c];
    if (in.flags().row_contiguous) {
      out.copy_shared_buffer(in);
    } else {
      out.set_data(mx::allocator::malloc(out.nbytes()));
      copies.push_back({in.data<char>(), out.data<char>(), in.shape(), in.strides(), in.itemsize()});
    }
  }
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (auto& in : inputs) encoder.set_input_array(in);
  for (auto& out : outputs) encoder.set_output_array(out);

  std::vector<const void*> in(inputs.size(), nullptr);
  for (size_t i = 0; i < inputs.size(); ++i)
    if (i != kKeys && i != kValues)  // those are read through the outputs
      in[i] = task_data(inputs[i], inputs[i].flags().row_contiguous, copies, temps);
  float* y = outputs[0].data<float>();
  float* kc = outputs[1].data<float>();
  float* vc = outputs[2].data<float>();
  const int64_t B = inputs[kX].shape(0), T = inputs[kX].shape(1), D = inputs[kX].shape(-1);
  const int64_t H = inputs[kQ].shape(0), Dh = inputs[kQ].shape(1);
  const int64_t KV = inputs[kK].shape(0), F = inputs[kGate].shape(0), S = inputs[kKeys].shape(2);
  const int dims = rope_dims_;
  const bool traditional = traditional_, bias = qkv_bias_;
  const int low_rank = low_rank_;
  const float eps = eps_, attn_scale = attn_scale_, rope_scale = rope_scale_;
  const int packed = packed_, affine = affine_;

  // a matrix in a lossless pack's form; in the affine 4-bit form; in the affine 8-bit one
  bool lossless = false, affine4_any = false, affine8_any = false;
  for (int i = 0; i < 7; ++i) {
    const int form = (packed >> (3 * i)) & 7;
    lossless = lossless || !(form == 0 || form == kAffine4 || form == kAffine8);
    affine4_any = affine4_any || form == kAffine4, affine8_any = affine8_any || form == kAffine8;
  }

  encoder.dispatch([=, copies = std::move(copies), temps = std::move(temps)]() {
    for (const auto& c : copies) c.run();
    auto f = [&](int i) { return static_cast<const float*>(in[i]); };
    int next_affine = kBiasQ + (bias ? 3 : 0);  // the first affine matrix's scales
    auto matrix = [&](int i, int64_t K) {
      int form = (packed >> (3 * (i - kQ))) & 7;  // 0 float32, kAffine4 / kAffine8, else a Pack's code
      Affine a{};
      const bool affine_form = form == kAffine4 || form == kAffine8;
      if (affine_form) {
        const int flags = affine >> (3 * (i - kQ));
        a = {static_cast<const uint32_t*>(in[i]), in[next_affine], in[next_affine + 1],
             static_cast<ScaleType>(flags & 3), ((flags >> 2) & 1) != 0, form == kAffine8 ? 8 : 4};
        next_affine += 2;
      }
      const bool lossless_form = form != 0 && !affine_form;
      return Matrix{form == 0 ? f(i) : nullptr, lossless_form ? in[i] : nullptr,
                    lossless_form ? static_cast<Pack>(form) : Pack::none, K, a};
    };
    const float *x = f(kX), *inv_freqs = f(kInvFreqs);
    const int32_t* starts = static_cast<const int32_t*>(in[kStarts]);
    const Matrix wq = matrix(kQ, D), wk = matrix(kK, D), wv = matrix(kV, D), wo = matrix(kO, H * Dh),
                 wg = matrix(kGate, D), wu = matrix(kUp, D), wd = matrix(kDown, F);
    const float *bq = bias ? f(kBiasQ) : nullptr, *bk = bias ? f(kBiasQ + 1) : nullptr,
                *bv = bias ? f(kBiasQ + 2) : nullptr;
    // the matrices' low-rank updates (q, k, v, o, gate, up, down), after the affine inputs
    LowRank lr[7];
    const int32_t* ids = low_rank ? static_cast<const int32_t*>(in[next_affine]) : nullptr;
    int64_t rank_max = 0;
    for (int i = 0, next = next_affine + 1; i < 7; ++i) {
      if (!((low_rank >> i) & 1)) continue;
      const auto& A = inputs[next];
      const bool dora = (low_rank >> (7 + i)) & 1;
      lr[i] = {f(next), f(next + 1), dora ? f(next + 2) : nullptr, ids, A.shape(0), A.shape(1), A.shape(2),
               inputs[next + 1].shape(1), T};
      rank_max = std::max(rank_max, lr[i].rank);
      next += dora ? 3 : 2;
    }
    // the offset and starts are read when the task runs (traced inputs of the compiled decode step)
    const int64_t off = static_cast<const int32_t*>(in[kOffset])[0];
    bool bad = off < 0 || off + T > S;
    for (int64_t b = 0; b < B; ++b) bad = bad || starts[b] < 0 || starts[b] > off + T - 1;
    for (const auto& u : lr)  // a slot past the bank's: loud NaNs too
      for (int64_t b = 0; u.a && u.slots > 1 && b < B; ++b) bad = bad || ids[b] < 0 || ids[b] >= u.slots;
    if (bad) {  // no slot to write, or a row with no column: loud NaNs rather than a write out of bounds
      std::fill(y, y + B * T * D, std::numeric_limits<float>::quiet_NaN());
      return;
    }
    // R rows of work: token t of row b is row b * T + t, at column off + t of cache row b
    const int64_t R = B * T;
    auto col = [&](int64_t r) { return off + r % T; };
    auto start = [&](int64_t r) { return std::min<int64_t>(starts[r / T], col(r)); };  // its first column
    // its position, as mx.fast.rope forms it: (t + offset) in float32, times the scale
    auto pos = [&](int64_t r) {
      return (static_cast<float>(r % T) + static_cast<float>(off - starts[r / T])) * rope_scale;
    };
    auto len = [&](int64_t r) { return col(r) + 1 - start(r); };  // the columns it attends to
    auto slot = [&](int64_t r, int64_t head) { return ((r / T * KV + head) * S + col(r)) * Dh; };
    const int64_t group = H / KV, heads = H + 2 * KV;
    // the attention's units: each row's KV heads' columns in parts (attend.h), laid out for the
    // longest row; a row's parts past its own are empty units
    const int64_t parts = attend_parts(off + T);
    const AttendPartials at{group, parts, attend_partial_floats(Dh)};
    const int64_t row_partials = at.floats(KV);
    std::vector<float> q(R * H * Dh), partials(R * row_partials), gate(R * F), up(R * F), act(R * F), down(R * D);
    const int64_t chunk_d = gemv_chunk(D, pool().threads()), chunk_f = gemv_chunk(F, pool().threads());
    auto chunks = [](int64_t n, int64_t chunk) { return static_cast<int>((n + chunk - 1) / chunk); };
    Phases phases({static_cast<int>(heads), static_cast<int>(R * KV * parts), chunks(D, chunk_d),
                   chunks(F, chunk_f), chunks(D, chunk_d)});

    std::vector<float> angles(R * dims);  // each row's RoPE angles, for all its heads
    for (int64_t r = 0; r < R; ++r) rope_angles(pos(r), inv_freqs, dims, angles.data() + r * dims);

    pool().run_crew([&] {
      // this thread's: every row's normed input, its attention output, a head's q, k or v for
      // every row, and a packed matrix's rows where they are unpacked (Matrix::unpacks)
      std::vector<float> xn(R * D), tmp(R * Dh), scores(group * kAttendPart), att(R * H * Dh);
      std::vector<float> unpacked(lossless && Matrix::unpacks(R) ? std::max({Dh * D, chunk_d * H * Dh, chunk_f * D, chunk_d * F}) : 0);
      QuantRows prepared4, prepared8;  // the input as the affine 4- and 8-bit matrices' integer forms read it
      std::vector<float> low(7 * R * rank_max);  // each low-rank update's A[s] v of every row
      auto shrink = [&](int i, const float* v) {
        if (lr[i].a) lr[i].shrink(v, R, low.data() + i * R * rank_max);
      };
      auto expand = [&](int i, float* out, int64_t N, int64_t o0, int64_t o1) {
        if (lr[i].a) lr[i].expand(low.data() + i * R * rank_max, R, out, N, o0, o1);
      };
      auto add_bias = [&](float* row, const float* b) {
        if (b)
          for (int64_t i = 0; i < Dh; ++i) row[i] += b[i];
      };
      auto prepare = [&](const float* v, int64_t n) {  // each row's (n floats a row)
        if (affine4_any) prepared4.reserve(R, n, 4), prepared4.prepare(v, 0, R);
        if (affine8_any) prepared8.reserve(R, n, 8), prepared8.prepare(v, 0, R);
      };
      auto norm_in = [&](const float* v, const float* w) {
        for (int64_t b = 0; b < R; ++b) rms_norm_row(v + b * D, w, xn.data() + b * D, D, eps);
        prepare(xn.data(), D);
      };
      // rows r0..r1 of w against every row of v (w's width a row), into out's first r1 - r0
      // columns (N floats a row): a row's sums the ones it gets decoded alone, whatever the rows
      auto products = [&](const Matrix& w, const float* v, float* out, int64_t N, int64_t r0, int64_t r1) {
        const Matrix rows = w.rows(r0);
        if (rows.affine.w) return rows.affine_rows(rows.affine.bits == 8 ? prepared8 : prepared4, R, out, N, r1 - r0);
        rows.gemv_rows(v, R, out, N, r1 - r0, unpacked.data());
      };

      // q, k and v of the normed input, a head at a time for every row; RoPE on q and k; k and v
      // into their slots
      phases.run(0, [&] {
        norm_in(x, f(kAttnNorm));
        for (int i = 0; i < 3; ++i) shrink(i, xn.data());
      }, [&](int64_t u) {
        const int which = u < H ? 0 : u < H + KV ? 1 : 2;  // q, k or v
        const Matrix& w = which == 0 ? wq : which == 1 ? wk : wv;
        const int64_t head = which == 0 ? u : which == 1 ? u - H : u - H - KV;
        const float* bias_row = which == 0 ? bq : which == 1 ? bk : bv;
        products(w, xn.data(), tmp.data(), Dh, head * Dh, (head + 1) * Dh);
        expand(which, tmp.data(), Dh, head * Dh, (head + 1) * Dh);  // (DoRA's rescale not on the bias)
        for (int64_t r = 0; r < R; ++r) add_bias(tmp.data() + r * Dh, bias_row ? bias_row + head * Dh : nullptr);
        for (int64_t r = 0; r < R; ++r) {
          float* row = tmp.data() + r * Dh;
          if (u < H) rope_turn(row, q.data() + (r * H + head) * Dh, Dh, dims, traditional, angles.data() + r * dims);
          else if (u < H + KV) rope_turn(row, kc + slot(r, head), Dh, dims, traditional, angles.data() + r * dims);
          else std::copy(row, row + Dh, vc + slot(r, head));
        }
      });

      // each row's KV heads' query heads against a part of the row's positions
      phases.run(1, [] {}, [&](int64_t u) {
        const int64_t r = u / (KV * parts), kv = (u / parts) % KV, p = u % parts, j0 = p * kAttendPart;
        if (j0 >= len(r)) return;
        const int64_t first = (r / T * KV + kv) * S + start(r);  // the row's first column
        attend_part(q.data() + (r * H + kv * group) * Dh, group, kc + first * Dh, vc + first * Dh, nullptr, j0,
                    std::min(len(r), j0 + kAttendPart), Dh, Dh, attn_scale, scores.data(),
                    partials.data() + r * row_partials + at.part(kv, p));
      });

      // y = x + W_o att, att the parts combined (by each thread that takes a unit, the same bits)
      auto combine = [&] {
        for (int64_t r = 0; r < R; ++r)
          for (int64_t h = 0; h < H; ++h)
            attend_combine(partials.data() + r * row_partials + at.head(h), attend_parts(len(r)), at.stride(), Dh,
                           att.data() + (r * H + h) * Dh);
        prepare(att.data(), H * Dh);
        shrink(3, att.data());
      };
      phases.run(2, combine, [&](int64_t c) {
        int64_t r0 = c * chunk_d, r1 = std::min(D, r0 + chunk_d);
        products(wo, att.data(), y + r0, D, r0, r1);
        expand(3, y + r0, D, r0, r1);
        for (int64_t b = 0; b < R; ++b)
          for (int64_t r = r0; r < r1; ++r) y[b * D + r] = x[b * D + r] + y[b * D + r];
      });

      // act = silu(W_gate yn) * (W_up yn), yn the normed y
      phases.run(3, [&] {
        norm_in(y, f(kFfnNorm));
        shrink(4, xn.data()), shrink(5, xn.data());
      }, [&](int64_t c) {
        int64_t r0 = c * chunk_f, r1 = std::min(F, r0 + chunk_f);
        products(wg, xn.data(), gate.data() + r0, F, r0, r1);
        expand(4, gate.data() + r0, F, r0, r1);
        products(wu, xn.data(), up.data() + r0, F, r0, r1);
        expand(5, up.data() + r0, F, r0, r1);
        for (int64_t b = 0; b < R; ++b)
          swiglu_span(gate.data() + b * F + r0, up.data() + b * F + r0, act.data() + b * F + r0, r1 - r0);
      });

      // y = y + W_down act
      phases.run(4, [&] {
        prepare(act.data(), F);
        shrink(6, act.data());
      }, [&](int64_t c) {
        int64_t r0 = c * chunk_d, r1 = std::min(D, r0 + chunk_d);
        products(wd, act.data(), down.data() + r0, D, r0, r1);
        expand(6, down.data() + r0, D, r0, r1);
        for (int64_t b = 0; b < R; ++b)
          for (int64_t r = r0; r < r1; ++r) y[b * D + r] = y[b * D + r] + down[b * D + r];
      });
    });
  });
}

std::vector<mx::array> decode_block(const mx::array& x, const std::vector<mx::array>& weights,
                                    const std::vector<mx::array>& biases, const mx::array& keys,
                                    const mx::array& values, const mx::array& offset, const mx::array& inv_freqs,
                                    int rope_dims, bool traditional, float eps, float attn_scale, float rope_scale,
                                    const std::optional<mx::array>& starts, const std::vector<mx::array>& affine,
                                    int symmetric, const std::vector<mx::array>& low_rank, int low_rank_of, int dora_of,
                                    const std::optional<mx::array>& ids, mx::StreamOrDevice st) {
  auto fail = [](const std::string& what) {
    throw std::invalid_argument("[mlxtoy_kernels] decode_block: " + what);
  };
  if (weights.size() != 9) fail("weights [attn_norm, q, k, v, o, ffn_norm, gate, up, down]");
  if (!biases.empty() && biases.size() != 3) fail("biases [] or [q, k, v]");
  if (x.ndim() != 3 || x.shape(0) < 1 || x.shape(1) < 1) fail("x (B, T, D): T new tokens of each of B rows");
  const int B = x.shape(0), D = x.shape(2);
  // a matrix's width: K float32, or a packed width (uint8: Q4, Q5 or Q8 blocks, told apart by it;
  // uint32: MLX's affine words, K / 8 at 4 bits or K / 4 at 8, with the next two arrays of `affine`)
  int packed = 0, affine_bits = 0;
  size_t next_affine = 0;
  auto width = [&](int i, int K) {
    const mx::array& w = weights[i];
    if (w.dtype() == mx::uint32) {
      if (next_affine + 2 > affine.size()) fail("affine: scales and biases for each uint32 matrix");
      const mx::array &sc = affine[next_affine], &bi = affine[next_affine + 1];
      next_affine += 2;
      const int64_t rows = w.size() / w.shape(-1);
      const int bits = w.shape(-1) * 8 == K ? 4 : w.shape(-1) * 4 == K ? 8 : 0;
      if (!bits || !integer_form(K, 32, bits) || sc.ndim() < 2 || sc.shape(-1) != K / 32 ||
          sc.size() != rows * (K / 32) || bi.shape() != sc.shape() || bi.dtype() != sc.dtype() ||
          !(sc.dtype() == mx::float32 || sc.dtype() == mx::float16 || sc.dtype() == mx::bfloat16))
        fail("an affine 4- or 8-bit matrix: words (.., K / 8) or (.., K / 4), scales and biases (rows, K / 32) "
             "float32, float16 or bfloat16, and a K and bits the integer forms take here (quant_integer_form)");
      packed |= (bits == 8 ? kAffine8 : kAffine4) << (3 * (i - 1));
      affine_bits |= (static_cast<int>(scale_type(sc)) | ((symmetric >> i) & 1) << 2) << (3 * (i - 1));
      return w.shape(-1);
    }
    if (w.dtype() != mx::uint8) return K;
    const int form = static_cast<int>(pack_of_width(K, w.shape(-1)));
    packed |= form << (3 * (i - 1));
    return form ? w.shape(-1) : -1;
  };
  // the matrices' logical shapes (their last axis read through `width`)
  auto lead = [&](int i) { return mx::Shape(weights[i].shape().begin(), weights[i].shape().end() - 1); };
  const auto &wq = weights[1], &wk = weights[2], &wv = weights[3];
  if (wq.ndim() != 3 || wk.ndim() != 3 || wv.ndim() != 3 || lead(2) != lead(3) || wk.shape(1) != wq.shape(1) ||
      wk.shape(0) == 0 || wq.shape(0) % wk.shape(0) != 0 || wq.shape(2) != width(1, D) ||
      wk.shape(2) != width(2, D) || wv.shape(2) != width(3, D))
    fail("q (H, Dh, D), k and v (KV, Dh, D), H a multiple of KV");
  const int H = wq.shape(0), KV = wk.shape(0), Dh = wq.shape(1);
  if (weights[0].shape() != mx::Shape{D} || weights[5].shape() != mx::Shape{D}) fail("norm weights (D,)");
  if (weights[4].shape() != mx::Shape{D, width(4, H * Dh)}) fail("o (D, H * Dh)");
  if (weights[6].ndim() != 2 || lead(7) != lead(6) || weights[6].shape(1) != width(6, D) ||
      weights[7].shape(1) != width(7, D))
    fail("gate and up (F, D), down (D, F)");
  const int F = weights[6].shape(0);
  if (weights[8].shape() != mx::Shape{D, width(8, F)}) fail("gate and up (F, D), down (D, F)");
  if (keys.ndim() != 4 || keys.shape(0) != B || keys.shape(1) != KV || keys.shape(3) != Dh ||
      values.shape() != keys.shape())
    fail("keys and values (B, KV, S, Dh)");
  if (offset.size() != 1 || offset.dtype() != mx::int32) fail("offset one int32");
  const mx::array first = starts ? *starts : mx::zeros({B}, mx::int32, st);
  if (first.shape() != mx::Shape{B} || first.dtype() != mx::int32) fail("starts (B,) int32");
  if (rope_dims <= 0 || rope_dims % 2 != 0 || rope_dims > Dh || inv_freqs.shape() != mx::Shape{rope_dims / 2})
    fail("rope_dims even and at most Dh, inv_freqs (rope_dims / 2,)");
  if (!biases.empty() && (biases[0].shape() != mx::Shape{H, Dh} || biases[1].shape() != mx::Shape{KV, Dh} ||
                          biases[2].shape() != mx::Shape{KV, Dh}))
    fail("biases q (H, Dh), k and v (KV, Dh)");
  const int T = x.shape(1);
  // each low-rank update's A (S, r, in) and B (S, out, r), in and out the matrix's
  const int dims_in[9] = {0, D, D, D, H * Dh, 0, D, D, F}, dims_out[9] = {0, H * Dh, KV * Dh, KV * Dh, D, 0, F, F, D};
  int low_rank_bits = 0;
  size_t next_low = 0;
  if (low_rank_of >> 9 || (dora_of & ~low_rank_of))
    fail("low_rank_of: bits of the matrices among the nine weights only; dora_of: some of them");
  for (int i = 0; i < 9; ++i) {
    if (!((low_rank_of >> i) & 1)) continue;
    const bool dora = (dora_of >> i) & 1;
    if (i == 0 || i == 5 || next_low + (dora ? 3 : 2) > low_rank.size())
      fail("low_rank: A and B (and k where dora_of) for each matrix set in low_rank_of, no more");
    const mx::array &a = low_rank[next_low], &b = low_rank[next_low + 1];
    if (dora && low_rank[next_low + 2].shape() != mx::Shape{b.shape(0), b.shape(1)})
      fail("low_rank: DoRA's k (S, out) with its A and B");
    next_low += dora ? 3 : 2;
    if (a.ndim() != 3 || b.ndim() != 3 || a.shape(0) < 1 || b.shape(0) != a.shape(0) || a.shape(2) != dims_in[i] ||
        b.shape(1) != dims_out[i] || b.shape(2) != a.shape(1))
      fail("low_rank: A (S, r, in) and B (S, out, r) of the matrix's in and out");
    if (a.shape(0) > 1 && !ids) fail("low_rank: ids (B,) for a bank of more than one slot");
    const int bit = i < 5 ? i - 1 : i - 2;  // the matrices q, k, v, o, gate, up, down
    low_rank_bits |= 1 << bit | (dora ? 1 << (7 + bit) : 0);
  }
  if (next_low != low_rank.size()) fail("low_rank: A and B (and k where dora_of) for each matrix set in low_rank_of, no more");
  if (ids && (ids->shape() != mx::Shape{B} || ids->dtype() != mx::int32)) fail("ids (B,) int32");
  std::vector<mx::array> inputs{x};
  inputs.insert(inputs.end(), weights.begin(), weights.end());
  inputs.insert(inputs.end(), {keys, values});
  std::vector<mx::array> floats{x, keys, values, inv_freqs};
  for (size_t i = 0; i < weights.size(); ++i)
    if (weights[i].dtype() != mx::uint8 && weights[i].dtype() != mx::uint32) floats.push_back(weights[i]);
  floats.insert(floats.end(), biases.begin(), biases.end());
  floats.insert(floats.end(), low_rank.begin(), low_rank.end());
  for (auto& a : floats)
    if (a.dtype() != mx::float32) fail("float32 arrays only (a matrix may be packed uint8, or affine 4- or 8-bit uint32)");
  if (next_affine != affine.size()) fail("affine: scales and biases for each uint32 matrix, no more");
  inputs.push_back(offset);
  inputs.push_back(first);
  inputs.push_back(inv_freqs);
  inputs.insert(inputs.end(), biases.begin(), biases.end());
  inputs.insert(inputs.end(), affine.begin(), affine.end());
  if (low_rank_bits) inputs.push_back(ids ? *ids : mx::zeros({B}, mx::int32, st));
  inputs.insert(inputs.end(), low_rank.begin(), low_rank.end());
  auto stream = mx::to_stream(st);
  if (stream.device != mx::Device::cpu) fail("CPU stream only");
  auto prim = std::make_shared<DecodeBlock>(stream, rope_dims, traditional, !biases.empty(), low_rank_bits, eps,
                                            attn_scale, rope_scale, packed, affine_bits);
  return mx::array::make_arrays({x.shape(), keys.shape(), values.shape()}, {mx::float32, mx::float32, mx::float32},
                                prim, std::move(inputs));
}

}  // namespace mlxtoy
