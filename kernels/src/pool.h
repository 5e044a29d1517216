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

// Spin rounds before a wait for work to be done sleeps: about the time of a few GEMV chunks.
inline const int kDoneSpins =
    std::getenv("MLXTOY_KERNEL_DONE_SPINS") ? std::atoi(std::getenv("MLXTOY_KERNEL_DONE_SPINS")) : 400;

// Returns once `count` has reached `target`: spins a while, then sleeps on it (whoever moves it
// to a target someone may wait for calls notify_all). Sleeping frees this core, so that the OS
// can move a thread it set aside here.
inline void await_count(const std::atomic<int>& count, int target) {
  for (int i = 0; i < kDoneSpins; ++i) {
    if (count.load(std::memory_order_acquire) >= target) return;
    cpu_relax();
  }
  for (int seen; (seen = count.load(std::memory_order_acquire)) < target;) count.wait(seen, std::memory_order_acquire);
}

// The phases of one job, shared by the threads that run it (`Pool::run_crew`): phase p has
// units[p] units, handed out first come, first served, and its units start once every unit of
// phase p - 1 is done. Threads wait for work to be done, never for one another to arrive: on
// two cores the interpreter's thread takes one of them now and then (building the next token's
// graph), and the thread it set aside then holds back only the unit in its hands, while the
// other goes on alone through the units left.
class Phases {
 public:
  explicit Phases(std::vector<int> units) : units_(std::move(units)), next_(units_.size()), done_(units_.size()) {}

  // Phase p on the calling thread: enter() once before the first unit it takes (not at all if
  // it takes none), then unit(u) for each unit u it takes.
  template <class Enter, class Unit>
  void run(size_t p, Enter&& enter, Unit&& unit) {
    if (p > 0) await_count(done_[p - 1], units_[p - 1]);
    bool entered = false;
    for (int u; (u = next_[p].fetch_add(1, std::memory_order_relaxed)) < units_[p];) {
      if (!entered) {
        enter();
        entered = true;
      }
      unit(u);
      if (done_[p].fetch_add(1, std::memory_order_acq_rel) + 1 == units_[p]) done_[p].notify_all();
    }
  }

 private:
  std::vector<int> units_;
  std::vector<std::atomic<int>> next_, done_;
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
      generation_.store(next_generation());
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

  // fn(begin, end) over chunks of [0, n) handed out first come, first served, by a crew
  // (`run_crew`): a worker that comes late takes fewer chunks, or none, instead of the caller
  // waiting for its fixed half. Only for work whose result does not depend on which thread
  // computes which chunk.
  void run_dynamic(int64_t n, int64_t chunk, const std::function<void(int64_t, int64_t)>& fn) {
    chunk = std::max<int64_t>(chunk, 1);
    if (n <= chunk || n_threads_ == 1) {
      fn(0, n);
      return;
    }
    std::atomic<int64_t> next{0};
    run_crew([&] {
      for (int64_t begin; (begin = next.fetch_add(chunk)) < n;) fn(begin, std::min(n, begin + chunk));
    });
  }

  // fn() on the calling thread and on each worker that comes for it before the calling thread
  // is through with it: for work any number of threads can finish (`Phases`), so no thread
  // waits for a worker the OS has not run yet. Returns once every thread that came is out of fn.
  void run_crew(const std::function<void()>& fn) {
    if (n_threads_ == 1) {
      fn();
      return;
    }
#ifdef MLXTOY_OPENMP
    if (openmp_) {
#pragma omp parallel num_threads(n_threads_)
      fn();
      return;
    }
#endif
    std::lock_guard<std::mutex> serial(run_mutex_);
    crew_job_ = &fn;
    crew_exits_.store(0);
    uint64_t generation = next_generation() | 1;
    crew_.store(crew_tag(generation));  // open, nobody in
    post(generation);
    fn();
    int came = static_cast<int>(crew_.fetch_or(kCrewClosed) & kCrewCount);
    await_count(crew_exits_, came);
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
    post(next_generation());
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
      if (seen & 1) {
        join_crew(seen);
        continue;
      }
      int parts = parts_;
      if (index < parts) (*job_)(index, n_ * index / parts, n_ * (index + 1) / parts);
      if (pending_.fetch_sub(1) == 1) {
        std::lock_guard<std::mutex> lock(mutex_);
        done_.notify_one();
      }
    }
  }

  // Jobs are numbered by generation_, its low bit saying whether the job is a crew's (read with
  // the number, in one load): the next even number.
  uint64_t next_generation() const { return (generation_.load() | 1) + 1; }

  // Publishes the job set up before it.
  void post(uint64_t generation) {
    generation_.store(generation);
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
  }

  static uint64_t crew_tag(uint64_t generation) { return (generation >> 1) << 32; }

  // A worker comes for the crew job of `generation`: it runs fn unless the job is closed or a
  // later one has replaced it, counted in and out so the caller knows whom to wait for.
  void join_crew(uint64_t generation) {
    uint64_t state = crew_.load();
    while ((state & ~(kCrewClosed | kCrewCount)) == crew_tag(generation) && !(state & kCrewClosed)) {
      if (crew_.compare_exchange_weak(state, state + 1)) {
        (*crew_job_)();
        crew_exits_.fetch_add(1);
        crew_exits_.notify_all();
        return;
      }
    }
  }

  static constexpr uint64_t kCrewClosed = uint64_t{1} << 31, kCrewCount = kCrewClosed - 1;

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
  const std::function<void()>* crew_job_ = nullptr;  // written before generation_ moves
  std::atomic<uint64_t> crew_{0};                    // crew_tag | closed | how many came
  std::atomic<int> crew_exits_{0};
  bool stop_ = false;
};

inline Pool& pool() {
  static Pool p;
  return p;
}

}  // namespace mlxtoy
