// Reading a 4-bit matrix for the decoding GEMV: MLX's row-major layout (8 rows a pass, each row
// its own stream, as kernels/src/qgemv.cpp reads it) against llama.cpp-style tiles of 8 rows
// interleaved block by block with their scales (one stream a thread). Same VNNI arithmetic, 2
// threads, 10 matrices of 14336 x 4096 (Q4_0 bytes, 4.5 bits a weight) read 3 times over.
//
//     g++ -O2 -std=c++17 -pthread bench/qgemv_layouts.cpp -o /tmp/qgemv_layouts
//     /tmp/qgemv_layouts [prefetch distance of the tiles in bytes, default 8192]
//
// Prints G weights/s of each, alternating; docs/performance.md quotes it.

#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <thread>
#include <vector>
constexpr int R = 8;
constexpr int64_t K = 4096, N = 14336, BLK = K / 128, MATS = 10;
struct X { alignas(64) int8_t b[BLK][256]; alignas(64) float xsl[BLK][16]; alignas(64) int32_t corr[BLK][16]; };
__attribute__((target("avx512f,avx512bw,avx512vnni,f16c")))
inline __m512 block(const uint8_t* qb, __m512 sv, const X& x, int64_t blk, __m512 acc) {
  const __m512i low4 = _mm512_set1_epi8(15);
  const __m512i v = _mm512_loadu_si512(qb);
  const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
  __m512i dh = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_load_si512(x.b[blk]));
  __m512i dl = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_load_si512(x.b[blk] + 64));
  dh = _mm512_dpbusd_epi32(dh, hi, _mm512_load_si512(x.b[blk] + 128));
  dl = _mm512_dpbusd_epi32(dl, hi, _mm512_load_si512(x.b[blk] + 192));
  __m512i d = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(dh, 8), dl), _mm512_load_si512(x.corr[blk]));
  return _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(d), _mm512_load_ps(x.xsl[blk])), sv, acc);
}
__attribute__((target("avx512f,avx512bw,avx512vnni,f16c")))
inline __m512 scales4(const uint16_t* s) {
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)s))));
}
// A: row-major words (N, K/2), scales (N, K/32)
__attribute__((target("avx512f,avx512bw,avx512vnni,f16c")))
void rows_a(const uint8_t* w, const uint16_t* s, const X& x, float* y, int64_t n0, int64_t n1) {
  const int64_t rb = K / 2, ahead = 2 * R;
  for (int64_t n = n0; n < n1; n += R) {
    for (int r = 0; r < R; ++r) for (int64_t o = 0; o < K / 32 * 2; o += 64) _mm_prefetch((const char*)(s + (n + r + ahead) * (K / 32)) + o, _MM_HINT_T1);
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < BLK; ++blk)
      for (int r = 0; r < R; ++r) {
        const uint8_t* qb = w + (n + r) * rb + blk * 64;
        _mm_prefetch((const char*)(qb + ahead * rb), _MM_HINT_T1);
        acc[r] = block(qb, scales4(s + (n + r) * (K / 32) + 4 * blk), x, blk, acc[r]);
      }
    for (int r = 0; r < R; ++r) y[n + r] = _mm512_reduce_add_ps(acc[r]);
  }
}
// B: tiles of R rows: per block [R x 64 B words][R x 4 scales] (576 B), tile after tile
__attribute__((target("avx512f,avx512bw,avx512vnni,f16c")))
void rows_b(const uint8_t* t, const X& x, float* y, int64_t n0, int64_t n1, int64_t dist) {
  const int64_t per = R * 64 + R * 8, tile = per * BLK;
  for (int64_t n = n0; n < n1; n += R) {
    const uint8_t* base = t + (n / R) * tile;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < BLK; ++blk) {
      const uint8_t* b = base + blk * per;
      for (int64_t o = 0; o < per; o += 64) _mm_prefetch((const char*)b + dist + o, _MM_HINT_T1);
      const uint16_t* sc = (const uint16_t*)(b + R * 64);
      for (int r = 0; r < R; ++r) acc[r] = block(b + r * 64, scales4(sc + 4 * r), x, blk, acc[r]);
    }
    for (int r = 0; r < R; ++r) y[n + r] = _mm512_reduce_add_ps(acc[r]);
  }
}
int main(int argc, char** argv) {
  int64_t dist = argc > 1 ? atoll(argv[1]) : 8192;
  std::vector<uint8_t*> wa(MATS), tb(MATS); std::vector<uint16_t*> sa(MATS);
  for (int m = 0; m < MATS; ++m) {
    wa[m] = (uint8_t*)aligned_alloc(64, N * K / 2 + 65536); sa[m] = (uint16_t*)aligned_alloc(64, N * K / 32 * 2 + 65536);
    tb[m] = (uint8_t*)aligned_alloc(64, N / R * (R * 64 + R * 8) * BLK + 65536);
    for (int64_t i = 0; i < N * K / 2; ++i) wa[m][i] = (uint8_t)(i * 7 + m);
    for (int64_t i = 0; i < N * K / 32; ++i) sa[m][i] = 0x3c00;
    memset(tb[m], 0x35, N / R * (R * 64 + R * 8) * BLK);
  }
  X x; memset(&x, 1, sizeof x);
  std::vector<float> y(N);
  auto run = [&](bool b) {
    auto t0 = std::chrono::steady_clock::now();
    for (int rep = 0; rep < 3; ++rep) for (int m = 0; m < MATS; ++m) {
      std::thread th([&] { if (b) rows_b(tb[m], x, y.data(), N / 2, N, dist); else rows_a(wa[m], sa[m], x, y.data(), N / 2, N); });
      if (b) rows_b(tb[m], x, y.data(), 0, N / 2, dist); else rows_a(wa[m], sa[m], x, y.data(), 0, N / 2);
      th.join();
    }
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return 3.0 * MATS * N * K / s / 1e9;
  };
  for (int i = 0; i < 4; ++i) printf("rows %.1f  tiles %.1f G weights/s\n", run(false), run(true));
}
