// GGUF block formats to float32, for loading: the simple blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)
// and the K-quants of the common mixes (Q4_K, Q5_K, Q6_K). Each weight is computed with the
// float32 operations, in the order, of gguf-py's numpy dequantizers (GGML's reference
// formulas): a scale times a small integer, then an offset added or subtracted as a separate
// rounding (no fused multiply-add: this file is compiled with fp-contract off). Blocks are
// split over as many threads as the kernels use; the caller releases Python's lock.

#pragma GCC optimize("fp-contract=off")

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kernels.h"
#include "loops.h"  // half_to_float
#include "pool.h"

namespace mlxtoy {

namespace {

// a GGUF block's float16 at p (little-endian) as float32. Out of line, as it was before it
// called half_to_float: inlined, gcc ordered the adds after it otherwise, and a block of garbage
// scales (NaN d and m) gave another NaN than gguf-py's (whose bits the tests compare)
__attribute__((noinline)) float half(const uint8_t* p) { return half_to_float(static_cast<uint16_t>(p[0] | (p[1] << 8))); }

constexpr int64_t kQK = 256;  // a K-quant super-block

void q4_0(const uint8_t* b, float* y) {
  float d = half(b);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * static_cast<float>((b[2 + j] & 0x0F) - 8);
    y[j + 16] = d * static_cast<float>((b[2 + j] >> 4) - 8);
  }
}

void q4_1(const uint8_t* b, float* y) {
  float d = half(b), m = half(b + 2);
  for (int j = 0; j < 16; ++j) {
    float lo = d * static_cast<float>(b[4 + j] & 0x0F), hi = d * static_cast<float>(b[4 + j] >> 4);
    y[j] = lo + m;
    y[j + 16] = hi + m;
  }
}

void q5(const uint8_t* b, float* y, bool with_min) {
  float d = half(b), m = with_min ? half(b + 2) : 0.0f;
  const uint8_t* qhp = b + (with_min ? 4 : 2);
  uint32_t qh = static_cast<uint32_t>(qhp[0]) | qhp[1] << 8 | qhp[2] << 16 | static_cast<uint32_t>(qhp[3]) << 24;
  const uint8_t* qs = qhp + 4;
  for (int j = 0; j < 32; ++j) {
    int q = (j < 16 ? qs[j] & 0x0F : qs[j - 16] >> 4) | ((qh >> j) & 1) << 4;
    if (with_min) {
      float v = d * static_cast<float>(q);
      y[j] = v + m;
    } else {
      y[j] = d * static_cast<float>(q - 16);
    }
  }
}

void q8_0(const uint8_t* b, float* y) {
  float d = half(b);
  for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(static_cast<int8_t>(b[2 + j])) * d;
}

// Q4_K / Q5_K: 8 groups of 32 with 6-bit scales and mins packed in 12 bytes
void scale_min(const uint8_t* s, int j, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[4 + j] & 63;
  } else {
    *sc = (s[8 + j - 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
    *mn = (s[8 + j - 4] >> 4) | ((s[4 + j - 4] >> 2) & 0x30);
  }
}

void q45_k(const uint8_t* b, float* y, bool five) {
  float d = half(b), dmin = half(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = five ? b + 16 : nullptr;
  const uint8_t* qs = b + (five ? 48 : 16);
  for (int g = 0; g < 8; ++g) {
    int sc, mn;
    scale_min(scales, g, &sc, &mn);
    float dg = d * static_cast<float>(sc), mg = dmin * static_cast<float>(mn);
    const uint8_t* q = qs + (g / 2) * 32;
    for (int i = 0; i < 32; ++i) {
      int v = g % 2 ? q[i] >> 4 : q[i] & 0x0F;
      if (five) v |= ((qh[i] >> g) & 1) << 4;
      float t = dg * static_cast<float>(v);
      y[g * 32 + i] = t - mg;
    }
  }
}

void q6_k(const uint8_t* b, float* y) {
  const uint8_t *ql = b, *qh = b + 128;
  const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
  float d = half(b + 208);
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 4; ++k)
      for (int i = 0; i < 32; ++i) {
        uint8_t l = ql[h * 64 + (k % 2) * 32 + i];
        int q = ((k < 2 ? l & 0x0F : l >> 4) | ((qh[h * 32 + i] >> (2 * k)) & 3) << 4) - 32;
        int o = (h * 4 + k) * 32 + i;
        float ds = d * static_cast<float>(scales[o / 16]);
        y[o] = ds * static_cast<float>(q);
      }
}

struct Format {
  int64_t bytes, values;
  void (*fn)(const uint8_t*, float*);
};

Format format(int type) {
  switch (type) {  // GGMLQuantizationType
    case 2: return {18, 32, q4_0};
    case 3: return {20, 32, q4_1};
    case 6: return {22, 32, [](const uint8_t* b, float* y) { q5(b, y, false); }};
    case 7: return {24, 32, [](const uint8_t* b, float* y) { q5(b, y, true); }};
    case 8: return {34, 32, q8_0};
    case 12: return {144, kQK, [](const uint8_t* b, float* y) { q45_k(b, y, false); }};
    case 13: return {176, kQK, [](const uint8_t* b, float* y) { q45_k(b, y, true); }};
    case 14: return {210, kQK, q6_k};
    default: return {0, 0, nullptr};
  }
}

// part(b0, b1) over [0, blocks) on threads of its own, not the kernels' team: this runs on the
// caller's (Python's) thread, and an OpenMP team started from there as well as from MLX's stream
// thread left libiomp's shutdown racing one of them at exit
template <class Part>
void over_blocks(int64_t blocks, const Part& part) {
  int64_t parts = std::min<int64_t>(default_threads(), blocks / 1024 + 1);
  std::vector<std::thread> others;
  for (int64_t i = 1; i < parts; ++i) others.emplace_back(part, blocks * i / parts, blocks * (i + 1) / parts);
  part(0, blocks / parts);
  for (auto& t : others) t.join();
}

}  // namespace

bool dequantizes(int type) { return format(type).fn != nullptr; }

void dequantize(const uint8_t* data, int64_t n_bytes, int type, float* out, int64_t n_values) {
  Format f = format(type);
  if (f.fn == nullptr) throw std::invalid_argument("[mlxtoy_kernels] dequantize: type " + std::to_string(type));
  if (n_bytes % f.bytes != 0 || n_bytes / f.bytes * f.values != n_values)
    throw std::invalid_argument("[mlxtoy_kernels] dequantize: " + std::to_string(n_bytes) + " bytes are not " +
                                std::to_string(n_values) + " values of type " + std::to_string(type));
  over_blocks(n_bytes / f.bytes, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) f.fn(data + b * f.bytes, out + b * f.values);
  });
}

void affine_blocks(const uint8_t* data, int64_t n_bytes, int type, int64_t blocks, uint8_t* packed,
                   uint16_t* scales, float* biases) {
  if (type != 2 && type != 3 && type != 8)
    throw std::invalid_argument("[mlxtoy_kernels] affine_blocks: type " + std::to_string(type));
  const int64_t size = format(type).bytes;
  if (n_bytes != blocks * size)
    throw std::invalid_argument("[mlxtoy_kernels] affine_blocks: " + std::to_string(n_bytes) + " bytes are not " +
                                std::to_string(blocks) + " blocks of type " + std::to_string(type));
  over_blocks(blocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* blk = data + b * size;
      scales[b] = static_cast<uint16_t>(blk[0] | (blk[1] << 8));
      if (type == 8) {  // Q8_0: int8 q * d = d * (q + 128) - 128 d, q + 128 as an unsigned byte
        biases[b] = half(blk) * -128.0f;
        for (int j = 0; j < 32; ++j) packed[b * 32 + j] = blk[2 + j] ^ 0x80;
        continue;
      }
      // Q4_0: (q - 8) d = d q - 8 d; Q4_1: d q + m. GGML holds element j in the low nibble of
      // byte j and j + 16 in its high one; MLX byte i holds elements 2i and 2i + 1.
      biases[b] = type == 3 ? half(blk + 2) : half(blk) * -8.0f;
      const uint8_t* qs = blk + (type == 3 ? 4 : 2);
      uint8_t* out = packed + b * 16;
      for (int i = 0; i < 8; ++i) {
        out[i] = static_cast<uint8_t>((qs[2 * i] & 0x0F) | (qs[2 * i + 1] << 4));
        out[8 + i] = static_cast<uint8_t>((qs[2 * i] >> 4) | (qs[2 * i + 1] & 0xF0));
      }
    }
  });
}

}  // namespace mlxtoy
