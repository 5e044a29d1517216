// mlxtoy kernels: copying a strided view into a contiguous buffer inside a task (included by
// the primitives' .cpp files).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"

namespace mx = mlx::core;

namespace mlxtoy {

namespace {

// An input that is not row-contiguous (a transposed or broadcast view) is copied into a
// contiguous buffer by the task itself, when its data is ready: the ops take any layout
// without adding a copy node to every graph for the common, contiguous case.
struct StridedCopy {
  const char* src;
  char* dst;
  mx::Shape shape;
  mx::Strides strides;  // in elements
  size_t itemsize;

  void run() const {
    int nd = static_cast<int>(shape.size());
    int64_t inner = nd ? shape.back() : 1, outer = 1;
    for (int d = 0; d + 1 < nd; ++d) outer *= shape[d];
    bool unit = nd == 0 || strides.back() == 1;
    std::vector<int64_t> idx(std::max(nd - 1, 0), 0);
    char* out = dst;
    for (int64_t r = 0; r < outer; ++r) {
      int64_t off = 0;
      for (int d = 0; d + 1 < nd; ++d) off += idx[d] * strides[d];
      const char* row = src + off * static_cast<int64_t>(itemsize);
      if (unit) {
        std::memcpy(out, row, inner * itemsize);
      } else {
        for (int64_t j = 0; j < inner; ++j)
          std::memcpy(out + j * itemsize, row + j * strides.back() * static_cast<int64_t>(itemsize), itemsize);
      }
      out += inner * itemsize;
      for (int d = nd - 2; d >= 0; --d) {
        if (++idx[d] < shape[d]) break;
        idx[d] = 0;
      }
    }
  }
};

// A task's pointer to input `a`: its own data where `in_place` (row-contiguous, or a layout the
// op reads through its strides), else a contiguous buffer the task fills first (a StridedCopy
// appended to `copies`; the buffer is held in `temps`, which the task holds).
inline const void* task_data(const mx::array& a, bool in_place, std::vector<StridedCopy>& copies,
                             std::vector<mx::array>& temps) {
  if (in_place) return a.data<void>();
  mx::array t(a.shape(), a.dtype(), nullptr, {});
  t.set_data(mx::allocator::malloc(t.nbytes()));
  copies.push_back({a.data<char>(), t.data<char>(), a.shape(), a.strides(), a.itemsize()});
  temps.push_back(t);
  return t.data<void>();
}

}  // namespace

}  // namespace mlxtoy
