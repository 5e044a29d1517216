// mlxtoy's CPU kernels: the float32 row-wise work that MLX's CPU backend runs unfused and on
// one thread (softmax, cross-entropy, RMSNorm, SwiGLU) and the small-batch GEMV of decoding
// (which MKL runs on one thread). Each is an MLX primitive evaluated on the CPU stream; rows
// are split over a small thread pool. Gradients are wired up in Python (mx.custom_function).

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <thread>
#include <vector>

#ifdef __linux__
#include <sched.h>
#endif

#include "mlx/backend/cpu/encoder.h"
#include "kernels.h"

namespace mlxtoy {

// ---- threads --------------------------------------------------------------------------------

namespace {

int default_threads() {
  if (const char* env = std::getenv("MLXTOY_KERNEL_THREADS")) {
    int n = std::atoi(env);
    if (n > 0) return n;
  }
#ifdef __linux__
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Spin this many rounds for the next job (or the workers' end) before sleeping: decoding calls
// the pool ~200 times per token, and a futex wake-up costs as much as a small GEMV.
static const int kSpins = std::getenv("MLXTOY_KERNEL_SPINS") ? std::atoi(std::getenv("MLXTOY_KERNEL_SPINS")) : 4000;

// A fixed pool: run_parts(n, grain, fn) calls fn(part, begin, end) on contiguous slices of
// [0, n) in order of part, one per thread, the calling thread taking part 0; run(n, grain, fn)
// calls fn(begin, end).
class Pool {
 public:
  Pool() : n_threads_(default_threads()) {
    for (int i = 1; i < n_threads_; ++i) workers_.emplace_back([this, i] { work(i); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
      generation_.fetch_add(1);
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }
  int threads() const { return n_threads_; }

  using Job = std::function<void(int, int64_t, int64_t)>;

  void run(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
    run_parts(n, grain, [&](int, int64_t begin, int64_t end) { fn(begin, end); });
  }

  // fn(begin, end) over chunks of [0, n) handed out first come, first served: a worker that
  // wakes late takes fewer chunks instead of the caller waiting for its fixed half. Only for
  // work whose result does not depend on which thread computes which chunk.
  void run_dynamic(int64_t n, int64_t chunk, const std::function<void(int64_t, int64_t)>& fn) {
    chunk = std::max<int64_t>(chunk, 1);
    if (n <= chunk || n_threads_ == 1) {
      fn(0, n);
      return;
    }
    std::atomic<int64_t> next{0};
    run_parts(n_threads_, 1, [&](int, int64_t, int64_t) {
      for (int64_t begin; (begin = next.fetch_add(chunk)) < n;) fn(begin, std::min(n, begin + chunk));
    });
  }

  void run_parts(int64_t n, int64_t grain, const Job& fn) {
    int parts = static_cast<int>(std::min<int64_t>(n_threads_, std::max<int64_t>(1, n / std::max<int64_t>(grain, 1))));
    if (parts <= 1) {
      fn(0, 0, n);
      return;
    }
    std::lock_guard<std::mutex> serial(run_mutex_);  // one parallel region at a time
    job_ = &fn;
    n_ = n;
    parts_ = parts;
    pending_.store(n_threads_ - 1);  // every worker checks in, with a slice or without
    generation_.fetch_add(1);
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    fn(0, 0, n / parts);
    for (int i = 0; i < kSpins && pending_.load() > 0; ++i) cpu_relax();
    if (pending_.load() > 0) {
      std::unique_lock<std::mutex> lock(mutex_);
      done_.wait(lock, [this] { return pending_.load() == 0; });
    }
  }

 private:
  void work(int index) {
    uint64_t seen = 0;  // the generation at construction: a job posted before this thread ran is still seen
    while (true) {
      for (int i = 0; i < kSpins && generation_.load() == seen; ++i) cpu_relax();
      if (generation_.load() == seen) {
        std::unique_lock<std::mutex> lock(mutex_);
        sleepers_.fetch_add(1);
        wake_.wait(lock, [&] { return generation_.load() != seen; });
        sleepers_.fetch_sub(1);
      }
      seen = generation_.load();
      if (stop_) return;
      int parts = parts_;
      if (index < parts) (*job_)(index, n_ * index / parts, n_ * (index + 1) / parts);
      if (pending_.fetch_sub(1) == 1) {
        std::lock_guard<std::mutex> lock(mutex_);
        done_.notify_one();
      }
    }
  }

  int n_threads_;
  std::vector<std::thread> workers_;
  std::mutex mutex_, run_mutex_;
  std::condition_variable wake_, done_;
  const Job* job_ = nullptr;  // written before generation_ moves
  int64_t n_ = 0;
  int parts_ = 0;
  std::atomic<int> pending_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<uint64_t> generation_{0};
  bool stop_ = false;
};

Pool& pool() {
  static Pool p;
  return p;
}

// Hot loops are compiled twice on x86-64: AVX2+FMA and baseline, picked at load time.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HOT __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define HOT
#endif

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// e^x for x <= 0 (or moderate x): Cody-Waite reduction to r in [-ln2/2, ln2/2], degree-6
// Taylor polynomial, times 2^n through the exponent bits (the same formula as fastmath._exp).
inline float poly_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to the nearest integer
  float t = x * 1.4426950408889634f + shifter;
  float n = t - shifter;
  float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
  float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(bits);
}

// ---- row kernels ----------------------------------------------------------------------------

// p = softmax(s + bias) over a row of length S; masked (-inf) entries give exactly 0, entries
// past the row's last unmasked one are not computed. Returns nothing; a row masked entirely
// is all zeros.
HOT void softmax_row(const float* s, const float* bias, float* p, int64_t S) {
  int64_t len = S;
  while (len > 0 && bias[len - 1] == kNegInf) --len;
  float m = kNegInf;
  for (int64_t j = 0; j < len; ++j) m = std::max(m, s[j] + bias[j]);
  if (m == kNegInf) {
    std::fill(p, p + S, 0.0f);
    return;
  }
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < len; ++j) {
    float v = s[j] + bias[j];
    float e = v == kNegInf ? 0.0f : poly_exp(v - m);
    p[j] = e;
    sum += e;
  }
  float inv = 1.0f / sum;
#pragma omp simd
  for (int64_t j = 0; j < len; ++j) p[j] *= inv;
  std::fill(p + len, p + S, 0.0f);
}

// ds = p * (dp - sum(p * dp)): the softmax's input gradient; p's zero tail is skipped.
HOT void softmax_grad_row(const float* p, const float* dp, float* ds, int64_t S) {
  int64_t len = S;
  while (len > 0 && p[len - 1] == 0.0f) --len;
  float delta = 0.0f;
#pragma omp simd reduction(+ : delta)
  for (int64_t j = 0; j < len; ++j) delta += p[j] * dp[j];
#pragma omp simd
  for (int64_t j = 0; j < len; ++j) ds[j] = p[j] * (dp[j] - delta);
  std::fill(ds + len, ds + S, 0.0f);
}

// ce = logsumexp(x) - x[target] and with d: d = softmax(x) - onehot(target), for logits laid out
// (V, C), one token per column (the output GEMM W @ h.T is the faster one that way round):
// columns [c0, c1). Each token's sum runs over the vocabulary in order, in double (a float sum
// over 49K terms loses ~1e-5 of the loss).
HOT void cross_entropy_columns(const float* x, const int32_t* t, float* ce, float* d, int64_t V, int64_t C,
                               int64_t c0, int64_t c1) {
  int64_t n = c1 - c0;
  std::vector<float> m(n, kNegInf), inv(n);
  std::vector<double> sum(n, 0.0);
  for (int64_t v = 0; v < V; ++v) {
    const float* row = x + v * C + c0;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) m[j] = std::max(m[j], row[j]);
  }
  for (int64_t v = 0; v < V; ++v) {
    const float* row = x + v * C + c0;
    float* drow = d ? d + v * C + c0 : nullptr;
    if (drow) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        float e = poly_exp(row[j] - m[j]);
        drow[j] = e;
        sum[j] += e;
      }
    } else {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) sum[j] += poly_exp(row[j] - m[j]);
    }
  }
  // a target outside the vocabulary gives a NaN loss (the step's non-finite guard sees it)
  auto valid = [&](int64_t j) { return t[c0 + j] >= 0 && t[c0 + j] < V; };
  for (int64_t j = 0; j < n; ++j) {
    float picked = valid(j) ? x[t[c0 + j] * C + c0 + j] : std::numeric_limits<float>::quiet_NaN();
    ce[c0 + j] = m[j] + static_cast<float>(std::log(sum[j])) - picked;
    inv[j] = static_cast<float>(1.0 / sum[j]);
  }
  if (!d) return;
  for (int64_t v = 0; v < V; ++v) {
    float* drow = d + v * C + c0;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) drow[j] *= inv[j];
  }
  for (int64_t j = 0; j < n; ++j)
    if (valid(j)) d[t[c0 + j] * C + c0 + j] -= 1.0f;
}

HOT void rms_norm_row(const float* x, const float* w, float* y, int64_t D, float eps) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < D; ++j) ss += x[j] * x[j];
  float r = 1.0f / std::sqrt(ss / D + eps);
#pragma omp simd
  for (int64_t j = 0; j < D; ++j) y[j] = w[j] * (x[j] * r);
}

// y = w * x * r with r = (mean(x^2) + eps)^-1/2:
// dx = r * w * g - x * r^3 * mean(x * w * g); dw += g * x * r.
HOT void rms_norm_grad_row(const float* x, const float* w, const float* g, float* dx, float* dw,
                           int64_t D, float eps) {
  float ss = 0.0f, xwg = 0.0f;
#pragma omp simd reduction(+ : ss, xwg)
  for (int64_t j = 0; j < D; ++j) {
    ss += x[j] * x[j];
    xwg += x[j] * w[j] * g[j];
  }
  float r = 1.0f / std::sqrt(ss / D + eps);
  float c = r * r * r * xwg / D;
#pragma omp simd
  for (int64_t j = 0; j < D; ++j) {
    dx[j] = r * w[j] * g[j] - c * x[j];
    dw[j] += g[j] * x[j] * r;
  }
}

HOT void swiglu_span(const float* a, const float* b, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = a[i] / (1.0f + poly_exp(-a[i])) * b[i];
}

// y = silu(a) * b: da = g * b * s * (1 + a * (1 - s)) with s = sigmoid(a); db = g * silu(a).
HOT void swiglu_grad_span(const float* a, const float* b, const float* g, float* da, float* db, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float s = 1.0f / (1.0f + poly_exp(-a[i]));
    da[i] = g[i] * b[i] * s * (1.0f + a[i] * (1.0f - s));
    db[i] = g[i] * a[i] * s;
  }
}

// y[m, n] = sum_k x[m, k] * W[n, k] for rows n in [n0, n1). (Four rows at a time, as four
// reductions in one simd loop, measured 1.6x slower: gcc does not vectorize it as well.)
HOT void gemv_span(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K,
                   int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* wr = w + n * K;
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = x + m * K;
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t k = 0; k < K; ++k) acc += xr[k] * wr[k];
      y[m * N + n] = acc;
    }
  }
}

// One query row against a KV head's cached keys and values: out = softmax(scale q.k + bias) v.
// Keys past the bias's last unmasked position are not read (the cache's unused capacity).
HOT void decode_attention_row(const float* q, const float* k, const float* v, const float* bias, float* out,
                              float* scores, int64_t S, int64_t D, int64_t Dv, float scale) {
  int64_t len = S;
  while (len > 0 && bias[len - 1] == kNegInf) --len;
  float m = kNegInf;
  for (int64_t j = 0; j < len; ++j) {
    const float* kr = k + j * D;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < D; ++d) dot += q[d] * kr[d];
    scores[j] = dot * scale + bias[j];
    m = std::max(m, scores[j]);
  }
  std::fill(out, out + Dv, 0.0f);
  if (m == kNegInf) return;  // every key masked: zeros, as the softmax kernel gives
  float sum = 0.0f;
  for (int64_t j = 0; j < len; ++j) {
    float e = scores[j] == kNegInf ? 0.0f : poly_exp(scores[j] - m);
    sum += e;
    if (e == 0.0f) continue;
    const float* vr = v + j * Dv;
#pragma omp simd
    for (int64_t d = 0; d < Dv; ++d) out[d] += e * vr[d];
  }
  float inv = 1.0f / sum;
#pragma omp simd
  for (int64_t d = 0; d < Dv; ++d) out[d] *= inv;
}

// AdamW without bias correction, in the order of mlx.optimizers.AdamW's ops, one rounding per op
// (no contraction into FMAs): m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2,
// p = p (1 - lr wd) - lr m / (sqrt(v) + eps), g first multiplied by grad_scale (gradient clipping)
// unless it is 1. ok == 0 keeps p, m and v.
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
HOT void adamw_span(const float* p, const float* g, const float* m, const float* v, float* po, float* mo,
                    float* vo, int64_t n, const float* sc) {
  const float lr = sc[0], b1 = sc[2], c1 = sc[3], b2 = sc[4], c2 = sc[5], eps = sc[6], wd = sc[7], gs = sc[8];
  if (sc[1] == 0.0f) {  // a step that is not applied
    if (po != p) std::memcpy(po, p, n * sizeof(float));
    if (mo != m) std::memcpy(mo, m, n * sizeof(float));
    if (vo != v) std::memcpy(vo, v, n * sizeof(float));
    return;
  }
  const float decay = 1.0f - lr * wd;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float gi = gs == 1.0f ? g[i] : g[i] * gs;
    float mi = b1 * m[i] + c1 * gi;
    float vi = b2 * v[i] + c2 * (gi * gi);
    po[i] = p[i] * decay - (lr * mi) / (std::sqrt(vi) + eps);
    mo[i] = mi;
    vo[i] = vi;
  }
}

constexpr int64_t kSumBlock = 1 << 16;  // sum_squares' fixed blocks

HOT double sum_squares_span(const float* x, int64_t n) {
  double acc = 0.0;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += static_cast<double>(x[i]) * x[i];
  return acc;
}

// a GEMV's rows per chunk: about eight chunks per thread, at least 16 rows
int64_t gemv_chunk(int64_t N, int threads) {
  return std::max<int64_t>(16, N / (8 * std::max(threads, 1)));
}

// rows per parallel slice so one slice is at least ~16K elements of work
int64_t grain(int64_t row_len) {
  return std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(row_len, 1));
}

}  // namespace

// ---- the primitive --------------------------------------------------------------------------

int kernel_threads() { return pool().threads(); }

void Kernel::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlxtoy_kernels] CPU kernels only");
}

bool Kernel::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const Kernel&>(other);
  return op_ == o.op_ && param_ == o.param_;
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
  for (auto& a : inputs) in.push_back(a.data<void>());
  for (auto& a : outputs) out.push_back(a.data<void>());
  const mx::Shape& shape0 = inputs[0].shape();
  int64_t last = shape0.back();
  int64_t rows = inputs[0].size() / std::max<int64_t>(last, 1);
  Op op = op_;
  float eps = param_;
  // Softmax: s (..., T, S), bias (Bb, T, S) with Bb 1 (rows_per_bias 0) or s's leading dim
  int64_t T = op == Op::Softmax ? inputs[1].shape(-2) : 0;
  int64_t rows_per_bias = op == Op::Softmax && inputs[1].shape(0) != 1 ? rows / inputs[1].shape(0) : 0;
  int64_t N = op == Op::Gemv ? inputs[1].shape(0) : 0;  // Gemv: w (N, K)
  std::vector<int64_t> Ns;  // GemvMany: each w_i's rows
  if (op == Op::GemvMany)
    for (size_t i = 1; i < inputs.size(); ++i) Ns.push_back(inputs[i].shape(0));
  // DecodeAttention: q (B, H, 1, D), k (B, KV, S, D), v (B, KV, S, Dv), bias (Bb, S)
  std::array<int64_t, 6> att{};  // B, H, KV, S, Dv, Bb
  if (op == Op::DecodeAttention)
    att = {inputs[0].shape(0), inputs[0].shape(1), inputs[1].shape(1), inputs[1].shape(2), inputs[2].shape(3),
           inputs[3].shape(0)};

  encoder.dispatch([op, eps, in, out, rows, last, T, rows_per_bias, N, Ns, att]() {
    Pool& threads = pool();
    switch (op) {
      case Op::Softmax: {
        auto s = static_cast<const float*>(in[0]);
        auto bias = static_cast<const float*>(in[1]);
        auto p = static_cast<float*>(out[0]);
        threads.run(rows, grain(last), [&](int64_t r0, int64_t r1) {
          for (int64_t r = r0; r < r1; ++r) {
            int64_t b = rows_per_bias ? r / rows_per_bias : 0;
            softmax_row(s + r * last, bias + (b * T + r % T) * last, p + r * last, last);
          }
        });
        break;
      }
      case Op::SoftmaxGrad: {
        auto p = static_cast<const float*>(in[0]);
        auto dp = static_cast<const float*>(in[1]);
        auto ds = static_cast<float*>(out[0]);
        threads.run(rows, grain(last), [&](int64_t r0, int64_t r1) {
          for (int64_t r = r0; r < r1; ++r) softmax_grad_row(p + r * last, dp + r * last, ds + r * last, last);
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
      case Op::Gemv: {
        auto x = static_cast<const float*>(in[0]);
        auto w = static_cast<const float*>(in[1]);
        auto y = static_cast<float*>(out[0]);
        threads.run_dynamic(N, gemv_chunk(N, threads.threads()),
                            [&](int64_t n0, int64_t n1) { gemv_span(x, w, y, rows, N, last, n0, n1); });
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
              gemv_span(x, static_cast<const float*>(in[i + 1]), static_cast<float*>(out[i]), rows, Ns[i], last, lo, hi);
            first += Ns[i];
          }
        });
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
        threads.run(B * H, std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(S * D, 1)), [&](int64_t r0, int64_t r1) {
          std::vector<float> scores(static_cast<size_t>(S));
          for (int64_t r = r0; r < r1; ++r) {
            int64_t b = r / H, kv = (r % H) / group;
            decode_attention_row(q + r * D, k + (b * KV + kv) * S * D, v + (b * KV + kv) * S * Dv,
                                 bias + (Bb == 1 ? 0 : b) * S, o + r * Dv, scores.data(), S, D, Dv, scale);
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
  return mx::contiguous(a);
}

std::vector<mx::array> make(Kernel::Op op, float eps, std::vector<mx::Shape> shapes,
                            std::vector<mx::Dtype> dtypes, std::vector<mx::array> inputs,
                            mx::StreamOrDevice s) {
  for (auto& a : inputs)
    if (a.ndim() == 0) throw std::invalid_argument("[mlxtoy_kernels] inputs must have at least one axis");
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) throw std::invalid_argument("[mlxtoy_kernels] CPU stream only");
  return mx::array::make_arrays(std::move(shapes), std::move(dtypes),
                                std::make_shared<Kernel>(stream, op, eps), std::move(inputs));
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

mx::array gemv(const mx::array& x, const mx::array& w, mx::StreamOrDevice st) {
  if (x.ndim() == 0 || w.ndim() != 2 || x.shape(-1) != w.shape(1))
    throw std::invalid_argument("[mlxtoy_kernels] gemv: x (..., K), w (N, K)");
  mx::Shape out = x.shape();
  out.back() = w.shape(0);
  return make(Kernel::Op::Gemv, 0, {out}, {mx::float32}, {f32(x, "x"), f32(w, "w")}, st)[0];
}

std::vector<mx::array> gemv_many(const mx::array& x, const std::vector<mx::array>& ws, mx::StreamOrDevice st) {
  if (x.ndim() == 0 || ws.empty())
    throw std::invalid_argument("[mlxtoy_kernels] gemv_many: x (..., K), ws [(N_i, K), ...]");
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  std::vector<mx::array> inputs{f32(x, "x")};
  for (auto& w : ws) {
    if (w.ndim() != 2 || w.shape(1) != x.shape(-1))
      throw std::invalid_argument("[mlxtoy_kernels] gemv_many: x (..., K), ws [(N_i, K), ...]");
    mx::Shape out = x.shape();
    out.back() = w.shape(0);
    shapes.push_back(out);
    dtypes.push_back(mx::float32);
    inputs.push_back(f32(w, "w"));
  }
  return make(Kernel::Op::GemvMany, 0, shapes, dtypes, inputs, st);
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

}  // namespace mlxtoy
