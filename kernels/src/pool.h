// mlxtoy kernels: the thread pool the row loops are split over (included by kernels.cpp and
// decode.cpp, which share the one pool).
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#ifdef __linux__
#include <sched.h>
#endif

#ifdef MLXTOY_OPENMP
#include <dlfcn.h>
#include <omp.h>

#include <cstring>
#include <string>
#endif

namespace mlxtoy {

// ---- threads --------------------------------------------------------------------------------
// (Not in an anonymous namespace: every translation unit shares the one pool.)

inline int default_threads() {
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
inline const int kSpins = std::getenv("MLXTOY_KERNEL_SPINS") ? std::atoi(std::getenv("MLXTOY_KERNEL_SPINS")) : 4000;

// Whether the parallel loops run as OpenMP regions: when the OpenMP runtime this module bound to
// is Intel's (libiomp5, loaded with global symbols by mlxtoy.backend next to MKL), its threads
// are the ones MKL's GEMMs run on, so the kernels share one team with the GEMMs instead of a
// second set of threads that fights MKL's spinning ones for the cores. Otherwise (libgomp, no
// OpenMP, another BLAS) the pool's own threads. MLXTOY_KERNEL_POOL=own|openmp forces one.
inline bool use_openmp() {
#ifdef MLXTOY_OPENMP
  if (const char* env = std::getenv("MLXTOY_KERNEL_POOL")) return std::string(env) == "openmp";
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&omp_get_thread_num), &info) && info.dli_fname)
    return std::strstr(info.dli_fname, "iomp") != nullptr;
#endif
  return false;
}

// Waits until all `parts` threads of a team have called wait() (a sense-reversing spin barrier,
// yielding the core after kSpins rounds): for the own pool's teams.
class SpinBarrier {
 public:
  explicit SpinBarrier(int parts) : parts_(parts) {}
  void wait() {
    int phase = phase_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == parts_ - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      phase_.fetch_add(1, std::memory_order_release);
      return;
    }
    for (int i = 0; phase_.load(std::memory_order_acquire) == phase; ++i) {
      if (i < kSpins) cpu_relax();
      else std::this_thread::yield();
    }
  }

 private:
  int parts_;
  std::atomic<int> arrived_{0};
  std::atomic<int> phase_{0};
};

// One thread's place in a team that runs a job with phases: part of parts, and sync(), which
// returns once every part has reached it (an OpenMP barrier on MKL's team, else a SpinBarrier).
struct Team {
  int part;
  int parts;
  SpinBarrier* barrier;

  void sync() const {
    if (parts == 1) return;
    if (barrier) {
      barrier->wait();
      return;
    }
#ifdef MLXTOY_OPENMP
#pragma omp barrier
#endif
  }
};

// A fixed pool: run_parts(n, grain, fn) calls fn(part, begin, end) on contiguous slices of
// [0, n) in order of part, one per thread, the calling thread taking part 0; run(n, grain, fn)
// calls fn(begin, end).
class Pool {
 public:
  Pool() : n_threads_(default_threads()), openmp_(use_openmp()) {
    if (!openmp_)
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
  bool openmp() const { return openmp_; }

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

  // fn(team) on every thread at once, for work that needs barriers between its phases: the
  // team's size is the one the runtime gave (an OpenMP team may be smaller than asked for).
  void run_team(const std::function<void(const Team&)>& fn) {
    if (n_threads_ == 1) {
      fn(Team{0, 1, nullptr});
      return;
    }
#ifdef MLXTOY_OPENMP
    if (openmp_) {
#pragma omp parallel num_threads(n_threads_)
      fn(Team{omp_get_thread_num(), omp_get_num_threads(), nullptr});
      return;
    }
#endif
    SpinBarrier barrier(n_threads_);
    run_parts(n_threads_, 1, [&](int part, int64_t, int64_t) { fn(Team{part, n_threads_, &barrier}); });
  }

  void run_parts(int64_t n, int64_t grain, const Job& fn) {
    int parts = static_cast<int>(std::min<int64_t>(n_threads_, std::max<int64_t>(1, n / std::max<int64_t>(grain, 1))));
    if (parts <= 1) {
      fn(0, 0, n);
      return;
    }
#ifdef MLXTOY_OPENMP
    if (openmp_) {
#pragma omp parallel num_threads(parts)
      {
        int i = omp_get_thread_num();
        fn(i, n * i / parts, n * (i + 1) / parts);
      }
      return;
    }
#endif
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
  bool openmp_;
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

inline Pool& pool() {
  static Pool p;
  return p;
}

}  // namespace mlxtoy
