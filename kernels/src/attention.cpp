// Attention over many query positions, forward and backward, for training and prefill:
//   p = softmax(scale q k^T + bias), out = p v;   (dq, dk, dv) for out's cotangent.
// q (B, KV, G*T, D) holds each KV head's G query heads stacked along the rows, k (B, KV, S, D),
// v (B, KV, S, Dv), bias (1|B, T, S) additive (0 and -inf).
//
// The rows go in blocks of kBlock query positions, and a block's GEMMs run only over the keys
// up to the last one any of its rows may see (its "open length", from the bias): under a causal
// mask the closed upper triangle is skipped but for the diagonal blocks. Each block is one task
// on the kernels' threads with its GEMMs on the BLAS MLX calls, each on the calling thread (MKL
// does so by itself inside its OpenMP team; an OpenBLAS is set to one thread for the call). p is
// not kept between the passes (it is B x H x T x S per layer): the forward returns each row's
// maximum and 1 / sum, and the backward computes the scores again and from them the same p. The
// backward's dk and dv sum over query rows: there a task owns a block of keys and runs over the
// row blocks in order, so no two tasks write one value and the sums do not depend on the thread
// count.

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <utility>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "blas.h"
#include "copy.h"
#include "kernels.h"
#include "loops.h"
#include "pool.h"

namespace mlxtoy {

// Attention over many query positions (training, prefill) and its gradient, as row blocks whose
// GEMMs stop at the block's last open key: a causal mask's closed half is never computed, and
// the probabilities are not kept for the gradient.
class BlockAttention : public mx::Primitive {
 public:
  BlockAttention(mx::Stream stream, bool grad, float scale) : mx::Primitive(stream), grad_(grad), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxtoyBlockAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  bool grad_;
  float scale_;
};

namespace {

constexpr int64_t kBlock = 64;

// An OpenBLAS's thread count, where the BLAS is one (loaded by mlxtoy.backend directly, or
// PyPI's behind libmlxtoy_blas): its GEMMs would otherwise each start its own threads from
// inside ours and oversubscribe the cores.
struct OpenBlasThreads {
  using Set = void (*)(int);
  using Get = int (*)();
  Set set = nullptr;
  Get get = nullptr;
  OpenBlasThreads() {
    for (auto names : {std::pair{"mlxtoy_blas_set_threads", "mlxtoy_blas_threads"},
                       std::pair{"openblas_set_num_threads", "openblas_get_num_threads"}}) {
      set = reinterpret_cast<Set>(dlsym(RTLD_DEFAULT, names.first));
      get = reinterpret_cast<Get>(dlsym(RTLD_DEFAULT, names.second));
      if (set && get) return;
    }
    set = nullptr;
  }
};

const OpenBlasThreads& openblas_threads() {
  static const OpenBlasThreads threads;
  return threads;
}

// The BLAS on one thread per caller for this object's lifetime (nothing where the kernels run on
// MKL's OpenMP team, inside which MKL does so by itself).
class SerialBlas {
 public:
  SerialBlas() {
    if (pool().openmp() || !openblas_threads().set) return;
    saved_ = openblas_threads().get();
    openblas_threads().set(1);
  }
  ~SerialBlas() {
    if (saved_ > 0) openblas_threads().set(saved_);
  }

 private:
  int saved_ = 0;
};

struct Dims {
  int64_t B, KV, G, T, S, D, Dv, Bb;
  int64_t row_blocks() const { return (T + kBlock - 1) / kBlock; }  // per query head
  int64_t key_blocks() const { return (S + kBlock - 1) / kBlock; }
};

// Per bias batch and row block: the open length of the block (the most of its rows'), and per
// bias row its own.
struct OpenLengths {
  std::vector<int64_t> row, block;

  OpenLengths(const float* bias, const Dims& d, Pool& threads) : row(d.Bb * d.T), block(d.Bb * d.row_blocks(), 0) {
    threads.run(d.Bb * d.T, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) row[r] = open_length(bias + r * d.S, d.S);
    });
    for (int64_t r = 0; r < d.Bb * d.T; ++r) {
      int64_t& b = block[(r / d.T) * d.row_blocks() + (r % d.T) / kBlock];
      b = std::max(b, row[r]);
    }
  }
};

// Task `task` of a pass over row blocks: item (b * KV + kv), query head g of its group, block j.
struct RowBlock {
  int64_t item, b, first_row, rows, t0;  // first_row: within the item's G * T rows

  RowBlock(int64_t task, const Dims& d) {
    int64_t nb = d.row_blocks(), j = task % nb, g = (task / nb) % d.G;
    item = task / (nb * d.G);
    b = item / d.KV;
    t0 = j * kBlock;
    rows = std::min(kBlock, d.T - t0);
    first_row = g * d.T + t0;
  }
  int64_t bias_row(const Dims& d) const { return (d.Bb == 1 ? 0 : b) * d.T + t0; }
  int64_t block(const Dims& d) const { return (d.Bb == 1 ? 0 : b) * d.row_blocks() + t0 / kBlock; }
};

}  // namespace

void BlockAttention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlxtoy_kernels] CPU kernels only");
}

bool BlockAttention::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const BlockAttention&>(other);
  return grad_ == o.grad_ && scale_ == o.scale_;
}

void BlockAttention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  for (auto& out : outputs) out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (auto& in : inputs) encoder.set_input_array(in);
  for (auto& out : outputs) encoder.set_output_array(out);
  std::vector<StridedCopy> copies;
  std::vector<mx::array> temps;
  std::vector<const float*> in;
  for (auto& a : inputs) in.push_back(static_cast<const float*>(task_data(a, a.flags().row_contiguous, copies, temps)));
  std::vector<float*> out;
  for (auto& a : outputs) out.push_back(a.data<float>());
  const mx::array &q = inputs[0], &k = inputs[1], &v = inputs[2], &bias = inputs[3];
  const Dims d{q.shape(0), k.shape(1), q.shape(2) / bias.shape(1), bias.shape(1), k.shape(2), q.shape(3),
               v.shape(3), bias.shape(0)};
  // p (B, KV, G * T, S) for the forward's row blocks, and the backward's p and ds: buffers of
  // the task's own, freed with it
  auto buffer = [&]() {
    mx::array t({q.shape(0), q.shape(1), q.shape(2), k.shape(2)}, mx::float32, nullptr, {});
    t.set_data(mx::allocator::malloc(t.nbytes()));
    temps.push_back(t);
    return t.data<float>();
  };
  float* p = buffer();
  float* ds = grad_ ? buffer() : nullptr;
  const bool grad = grad_;
  const float scale = scale_;

  encoder.dispatch([=, copies = std::move(copies), temps = std::move(temps)]() {
    for (const auto& c : copies) c.run();
    Pool& threads = pool();
    const SerialBlas serial_blas;
    const OpenLengths open(in[3], d, threads);
    const int64_t GT = d.G * d.T, n_row_tasks = d.B * d.KV * d.G * d.row_blocks();
    auto item_of = [](auto* base, int64_t item, int64_t rows_per_item, int64_t width) {
      return base + item * rows_per_item * width;
    };
    // the columns of a row block's p and ds that the passes read: its open length, up to a
    // whole key block
    auto read_width = [&](int64_t kl) { return std::min(d.S, (kl + kBlock - 1) / kBlock * kBlock); };
    if (!grad) {
      // out, stats (m, 1 / sum per row) from q, k, v, bias
      float *o = out[0], *stats = out[1];
      threads.run_dynamic(n_row_tasks, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t task = t0; task < t1; ++task) {
          RowBlock rb(task, d);
          float* pr = item_of(p, rb.item, GT, d.S) + rb.first_row * d.S;
          float* orow = item_of(o, rb.item, GT, d.Dv) + rb.first_row * d.Dv;
          float* st = item_of(stats, rb.item, GT, 2) + rb.first_row * 2;
          int64_t kl = open.block[rb.block(d)];
          if (kl == 0) {
            std::fill(orow, orow + rb.rows * d.Dv, 0.0f);
            for (int64_t r = 0; r < rb.rows; ++r) st[2 * r] = kNegInf, st[2 * r + 1] = 0.0f;
            continue;
          }
          blas_gemm(false, true, rb.rows, kl, d.D, scale, item_of(in[0], rb.item, GT, d.D) + rb.first_row * d.D, d.D,
               item_of(in[1], rb.item, d.S, d.D), d.D, 0.0f, pr, d.S);
          for (int64_t r = 0; r < rb.rows; ++r) {
            int64_t br = rb.bias_row(d) + r;
            RowStats rs = softmax_row(pr + r * d.S, in[3] + br * d.S, pr + r * d.S, kl, open.row[br]);
            st[2 * r] = rs.m;
            st[2 * r + 1] = rs.inv;
          }
          blas_gemm(false, false, rb.rows, d.Dv, kl, 1.0f, pr, d.S, item_of(in[2], rb.item, d.S, d.Dv), d.Dv, 0.0f, orow,
               d.Dv);
        }
      });
      return;
    }
    // dq, dk, dv from q, k, v, bias, stats, d_out. Pass 1, per row block: p again, ds =
    // softmax_grad(p, d_out v^T), dq = scale ds k.
    const float *stats = in[4], *dout = in[5];
    float *dq = out[0], *dk = out[1], *dv = out[2];
    threads.run_dynamic(n_row_tasks, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t task = t0; task < t1; ++task) {
        RowBlock rb(task, d);
        float* dqr = item_of(dq, rb.item, GT, d.D) + rb.first_row * d.D;
        int64_t kl = open.block[rb.block(d)];
        if (kl == 0) {  // p is 0 here, and pass 2 does not read these rows
          std::fill(dqr, dqr + rb.rows * d.D, 0.0f);
          continue;
        }
        int64_t width = read_width(kl);
        float* pr = item_of(p, rb.item, GT, d.S) + rb.first_row * d.S;
        float* dsr = item_of(ds, rb.item, GT, d.S) + rb.first_row * d.S;
        const float* st = item_of(stats, rb.item, GT, 2) + rb.first_row * 2;
        blas_gemm(false, true, rb.rows, kl, d.D, scale, item_of(in[0], rb.item, GT, d.D) + rb.first_row * d.D, d.D,
             item_of(in[1], rb.item, d.S, d.D), d.D, 0.0f, pr, d.S);
        blas_gemm(false, true, rb.rows, kl, d.Dv, 1.0f, item_of(dout, rb.item, GT, d.Dv) + rb.first_row * d.Dv, d.Dv,
             item_of(in[2], rb.item, d.S, d.Dv), d.Dv, 0.0f, dsr, d.S);
        for (int64_t r = 0; r < rb.rows; ++r) {
          int64_t br = rb.bias_row(d) + r;
          softmax_row_again(pr + r * d.S, in[3] + br * d.S, pr + r * d.S, width, open.row[br],
                            RowStats{st[2 * r], st[2 * r + 1]});
          softmax_grad_row(pr + r * d.S, dsr + r * d.S, dsr + r * d.S, width, open.row[br]);
        }
        blas_gemm(false, false, rb.rows, d.D, kl, scale, dsr, d.S, item_of(in[1], rb.item, d.S, d.D), d.D, 0.0f, dqr, d.D);
      }
    });
    // Pass 2, per key block [c0, c1): dv = p^T d_out and dk = scale ds^T q over the row blocks
    // that see any of those keys, consecutive ones as one GEMM.
    const int64_t nc = d.key_blocks(), nb = d.row_blocks();
    threads.run_dynamic(d.B * d.KV * nc, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t task = t0; task < t1; ++task) {
        int64_t item = task / nc, b = item / d.KV, c0 = (task % nc) * kBlock, w = std::min(kBlock, d.S - c0);
        float* dvr = item_of(dv, item, d.S, d.Dv) + c0 * d.Dv;
        float* dkr = item_of(dk, item, d.S, d.D) + c0 * d.D;
        float beta = 0.0f;
        auto flush = [&](int64_t r0, int64_t r1) {
          if (r0 == r1) return;
          blas_gemm(true, false, w, d.Dv, r1 - r0, 1.0f, item_of(p, item, GT, d.S) + r0 * d.S + c0, d.S,
               item_of(dout, item, GT, d.Dv) + r0 * d.Dv, d.Dv, beta, dvr, d.Dv);
          blas_gemm(true, false, w, d.D, r1 - r0, scale, item_of(ds, item, GT, d.S) + r0 * d.S + c0, d.S,
               item_of(in[0], item, GT, d.D) + r0 * d.D, d.D, beta, dkr, d.D);
          beta = 1.0f;
        };
        int64_t run0 = 0, run1 = 0;  // the current run of rows that see the key block
        for (int64_t g = 0; g < d.G; ++g)
          for (int64_t j = 0; j < nb; ++j) {
            int64_t r0 = g * d.T + j * kBlock, r1 = std::min(g * d.T + (j + 1) * kBlock, (g + 1) * d.T);
            if (open.block[(d.Bb == 1 ? 0 : b) * nb + j] > c0) {
              if (r0 != run1) {
                flush(run0, run1);
                run0 = r0;
              }
              run1 = r1;
            }
          }
        flush(run0, run1);
        if (beta == 0.0f) {  // no query sees these keys
          std::fill(dvr, dvr + w * d.Dv, 0.0f);
          std::fill(dkr, dkr + w * d.D, 0.0f);
        }
      }
    });
  });
}

bool block_attention_ok() { return pool().openmp() || openblas_threads().set != nullptr; }

namespace {

void check(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& bias) {
  for (auto* a : {&q, &k, &v, &bias})
    if (a->dtype() != mx::float32) throw std::invalid_argument("[mlxtoy_kernels] attention: float32 only");
  bool ok = q.ndim() == 4 && k.ndim() == 4 && v.ndim() == 4 && bias.ndim() == 3 && k.shape(0) == q.shape(0) &&
            v.shape(0) == q.shape(0) && k.shape(1) == q.shape(1) && v.shape(1) == k.shape(1) &&
            v.shape(2) == k.shape(2) && k.shape(3) == q.shape(3) && bias.shape(2) == k.shape(2) &&
            bias.shape(1) > 0 && q.shape(2) % bias.shape(1) == 0 &&
            (bias.shape(0) == 1 || bias.shape(0) == q.shape(0));
  if (!ok)
    throw std::invalid_argument(
        "[mlxtoy_kernels] attention: q (B, KV, G * T, D), k (B, KV, S, D), v (B, KV, S, Dv), bias (1|B, T, S)");
}

std::vector<mx::array> make(bool grad, float scale, std::vector<mx::Shape> shapes, std::vector<mx::array> inputs,
                            mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) throw std::invalid_argument("[mlxtoy_kernels] CPU stream only");
  std::vector<mx::Dtype> dtypes(shapes.size(), mx::float32);
  return mx::array::make_arrays(std::move(shapes), std::move(dtypes),
                                std::make_shared<BlockAttention>(stream, grad, scale), std::move(inputs));
}

}  // namespace

std::vector<mx::array> attention(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& bias,
                                 float scale, mx::StreamOrDevice st) {
  check(q, k, v, bias);
  mx::Shape out{q.shape(0), q.shape(1), q.shape(2), v.shape(3)}, stats{q.shape(0), q.shape(1), q.shape(2), 2};
  return make(false, scale, {out, stats}, {q, k, v, bias}, st);
}

std::vector<mx::array> attention_grad(const mx::array& q, const mx::array& k, const mx::array& v,
                                      const mx::array& bias, const mx::array& stats, const mx::array& d_out,
                                      float scale, mx::StreamOrDevice st) {
  check(q, k, v, bias);
  mx::Shape ss{q.shape(0), q.shape(1), q.shape(2), 2}, os{q.shape(0), q.shape(1), q.shape(2), v.shape(3)};
  if (stats.shape() != ss || d_out.shape() != os || stats.dtype() != mx::float32 || d_out.dtype() != mx::float32)
    throw std::invalid_argument("[mlxtoy_kernels] attention_grad: stats (B, KV, G * T, 2), d_out (B, KV, G * T, Dv)");
  return make(true, scale, {q.shape(), k.shape(), v.shape()}, {q, k, v, bias, stats, d_out}, st);
}

}  // namespace mlxtoy
