// CPU kernels of the batch-norm ops (csrc/ops/syncbn.cpp).
//
// Reductions are split into work items of about kItem elements: (channel,
// element range) for NCS inputs and (tile of kTile channels, row range) for
// NSC inputs, so that both few large channels and many small ones keep every
// thread busy. Each item converts blocks of its elements to float32 in a small
// buffer and reduces the buffer with Vectorized<float>; block results are
// merged in double, and items are merged per channel in a fixed order, so the
// results do not depend on the number of threads.
//
// NOTE [batch-norm statistics]: a block's mean and M2 (sum of squared
// deviations) come from two passes over the block while it sits in L1 (sum,
// then sum of (x - block mean)^2), i.e. one pass over memory. Blocks and items
// are merged with Chan's formula in double. The fp32 rounding error of a block
// is then relative to the block's own spread (about kBlock * eps of M2, no
// cancellation against the mean), which is as accurate as a two-pass float64
// computation for any realistic block; shifted or raw sums of squares lose
// accuracy when |mean| >> std.
#include <torch/library.h>
#include <ATen/Dispatch.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <vector>

#include "../common/bn_math.h"
#include "../common/syncbn.h"
#include "parallel.h"

namespace fusetrain {
namespace detail {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVS = Vec::size();
constexpr int64_t kItem = 32768;  // elements per work item (reductions)
constexpr int64_t kBlock = 2048;  // floats per block buffer (NCS)
constexpr int64_t kTile = 64;     // channels per tile (NSC)
constexpr int64_t kRows = kBlock / kTile;  // rows per block (NSC)

inline float reduce_lanes(const Vec& v) {
  alignas(64) float lanes[kVS];
  v.store(lanes);
  float s = 0.f;
  for (int64_t i = 0; i < kVS; ++i) s += lanes[i];
  return s;
}

// Convert len elements to float32 (a copy for float).
template <typename T>
inline void to_float(const T* src, float* dst, int64_t len) {
  at::vec::convert(src, dst, len);
}

// Per-channel partial statistics in double, merged with Chan's formula.
struct Moments {
  double n = 0.0, mean = 0.0, m2 = 0.0;
  void merge(double nb, double mean_b, double m2_b) { chan_merge(n, mean, m2, nb, mean_b, m2_b); }
};

// Elements [begin, end) of channel c of an NCS input (in (n, s) order) are
// gathered into blocks of at most kBlock: gather(dst_pos, src_offset, len) for
// each piece, then flush(block_len) for each block.
template <typename Gather, typename Flush>
void ncs_blocks(const BnShape& sh, int64_t c, int64_t begin, int64_t end, Gather&& gather, Flush&& flush) {
  int64_t filled = 0;
  int64_t e = begin;
  while (e < end) {
    const int64_t n = e / sh.S, s = e % sh.S;
    const int64_t len = std::min({sh.S - s, end - e, kBlock - filled});
    gather(filled, (n * sh.C + c) * sh.S + s, len);
    filled += len;
    e += len;
    if (filled == kBlock) {
      flush(filled);
      filled = 0;
    }
  }
  if (filled > 0) flush(filled);
}

// Rows [r0, r1) of the channel tile [c0, c0 + w) of an NSC input, in blocks of
// at most kRows rows; gather(row_in_block, src_offset, w), then flush(rows).
template <typename Gather, typename Flush>
void nsc_blocks(const BnShape& sh, int64_t c0, int64_t w, int64_t r0, int64_t r1, Gather&& gather, Flush&& flush) {
  for (int64_t rb = r0; rb < r1; rb += kRows) {
    const int64_t nr = std::min(kRows, r1 - rb);
    for (int64_t r = 0; r < nr; ++r) gather(r, (rb + r) * sh.C + c0, w);
    flush(nr);
  }
}

// The work items of a per-channel reduction.
struct Item {
  int64_t c0, w;        // channel or channel tile
  int64_t begin, end;   // element range (NCS) or row range (NSC)
};

std::vector<Item> make_items(const BnShape& sh) {
  std::vector<Item> items;
  const int64_t L = sh.per_channel();
  if (L == 0) return items;
  if (sh.layout == BnLayout::NCS) {
    for (int64_t c = 0; c < sh.C; ++c) {
      for (int64_t b = 0; b < L; b += kItem) items.push_back({c, 1, b, std::min(L, b + kItem)});
    }
  } else {
    const int64_t rows_per_item = std::max<int64_t>(kRows, kItem / std::min(kTile, sh.C) / kRows * kRows);
    for (int64_t c0 = 0; c0 < sh.C; c0 += kTile) {
      const int64_t w = std::min(kTile, sh.C - c0);
      for (int64_t b = 0; b < L; b += rows_per_item) items.push_back({c0, w, b, std::min(L, b + rows_per_item)});
    }
  }
  return items;
}

// Stats of one block of len floats: mean and M2 (two passes over the buffer).
inline void block_moments(const float* buf, int64_t len, float* mean_out, float* m2_out) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + kVS <= len; i += kVS) acc = acc + Vec::loadu(buf + i);
  if (i < len) acc = acc + Vec::loadu(buf + i, static_cast<int>(len - i));
  const float mean = reduce_lanes(acc) / static_cast<float>(len);
  const Vec vm(mean);
  Vec q(0.f);
  for (i = 0; i + kVS <= len; i += kVS) {
    const Vec d = Vec::loadu(buf + i) - vm;
    q = at::vec::fmadd(d, d, q);
  }
  if (i < len) {
    // Masked lanes load as 0; their (0 - mean)^2 is removed by the select.
    const Vec d = Vec::set(Vec(0.f), Vec::loadu(buf + i, static_cast<int>(len - i)) - vm, len - i);
    q = at::vec::fmadd(d, d, q);
  }
  *mean_out = mean;
  *m2_out = reduce_lanes(q);
}

template <typename T>
void stats_kernel(const T* x, const BnShape& sh, float* mean_out, float* m2_out) {
  const std::vector<Item> items = make_items(sh);
  // One Moments per (item, channel of the item).
  std::vector<int64_t> slot(items.size() + 1, 0);
  for (size_t i = 0; i < items.size(); ++i) slot[i + 1] = slot[i] + items[i].w;
  std::vector<Moments> parts(slot.back());
  parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t ib, int64_t ie) {
    alignas(64) float buf[kBlock];
    alignas(64) float bmean[kTile];
    alignas(64) float bm2[kTile];
    for (int64_t ii = ib; ii < ie; ++ii) {
      const Item& it = items[ii];
      Moments* out = parts.data() + slot[ii];
      if (sh.layout == BnLayout::NCS) {
        ncs_blocks(
            sh, it.c0, it.begin, it.end, [&](int64_t pos, int64_t off, int64_t len) { to_float(x + off, buf + pos, len); },
            [&](int64_t len) {
              float m, q;
              block_moments(buf, len, &m, &q);
              out->merge(static_cast<double>(len), m, q);
            });
      } else {
        nsc_blocks(
            sh, it.c0, it.w, it.begin, it.end,
            [&](int64_t r, int64_t off, int64_t w) { to_float(x + off, buf + r * kTile, w); },
            [&](int64_t nr) {
              const Vec inv_n(1.f / static_cast<float>(nr));
              for (int64_t j = 0; j < it.w; j += kVS) {
                Vec s(0.f);
                for (int64_t r = 0; r < nr; ++r) s = s + Vec::loadu(buf + r * kTile + j);
                const Vec m = s * inv_n;
                Vec q(0.f);
                for (int64_t r = 0; r < nr; ++r) {
                  const Vec d = Vec::loadu(buf + r * kTile + j) - m;
                  q = at::vec::fmadd(d, d, q);
                }
                m.store(bmean + j);
                q.store(bm2 + j);
              }
              for (int64_t j = 0; j < it.w; ++j) out[j].merge(static_cast<double>(nr), bmean[j], bm2[j]);
            });
      }
    }
  });
  std::vector<Moments> total(sh.C);
  for (size_t i = 0; i < items.size(); ++i) {
    for (int64_t j = 0; j < items[i].w; ++j) {
      const Moments& p = parts[slot[i] + j];
      total[items[i].c0 + j].merge(p.n, p.mean, p.m2);
    }
  }
  for (int64_t c = 0; c < sh.C; ++c) {
    mean_out[c] = static_cast<float>(total[c].mean);
    m2_out[c] = static_cast<float>(total[c].m2);
  }
}

template <typename T>
void backward_reduce_kernel(const T* dy, const T* x, const float* mean, const BnShape& sh, float* sum_dy_out,
                            float* sum_dy_xmu_out) {
  const std::vector<Item> items = make_items(sh);
  std::vector<int64_t> slot(items.size() + 1, 0);
  for (size_t i = 0; i < items.size(); ++i) slot[i + 1] = slot[i] + items[i].w;
  std::vector<double> part_dy(slot.back(), 0.0), part_dyx(slot.back(), 0.0);
  parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t ib, int64_t ie) {
    alignas(64) float bdy[kBlock];
    alignas(64) float bx[kBlock];
    alignas(64) float s1[kTile];
    alignas(64) float s2[kTile];
    for (int64_t ii = ib; ii < ie; ++ii) {
      const Item& it = items[ii];
      double* o1 = part_dy.data() + slot[ii];
      double* o2 = part_dyx.data() + slot[ii];
      if (sh.layout == BnLayout::NCS) {
        const Vec m(mean[it.c0]);
        ncs_blocks(
            sh, it.c0, it.begin, it.end,
            [&](int64_t pos, int64_t off, int64_t len) {
              to_float(dy + off, bdy + pos, len);
              to_float(x + off, bx + pos, len);
            },
            [&](int64_t len) {
              Vec a(0.f), b(0.f);
              int64_t i = 0;
              for (; i + kVS <= len; i += kVS) {
                const Vec g = Vec::loadu(bdy + i);
                a = a + g;
                b = at::vec::fmadd(g, Vec::loadu(bx + i) - m, b);
              }
              if (i < len) {
                const int r = static_cast<int>(len - i);
                const Vec g = Vec::loadu(bdy + i, r);  // masked lanes are 0
                a = a + g;
                b = at::vec::fmadd(g, Vec::loadu(bx + i, r) - m, b);
              }
              *o1 += reduce_lanes(a);
              *o2 += reduce_lanes(b);
            });
      } else {
        nsc_blocks(
            sh, it.c0, it.w, it.begin, it.end,
            [&](int64_t r, int64_t off, int64_t w) {
              to_float(dy + off, bdy + r * kTile, w);
              to_float(x + off, bx + r * kTile, w);
            },
            [&](int64_t nr) {
              for (int64_t j = 0; j < it.w; j += kVS) {
                const int lanes = static_cast<int>(std::min<int64_t>(kVS, it.w - j));
                const Vec m = Vec::loadu(mean + it.c0 + j, lanes);
                Vec a(0.f), b(0.f);
                for (int64_t r = 0; r < nr; ++r) {
                  const Vec g = Vec::loadu(bdy + r * kTile + j);
                  a = a + g;
                  b = at::vec::fmadd(g, Vec::loadu(bx + r * kTile + j) - m, b);
                }
                a.store(s1 + j);
                b.store(s2 + j);
              }
              for (int64_t j = 0; j < it.w; ++j) {
                o1[j] += s1[j];
                o2[j] += s2[j];
              }
            });
      }
    }
  });
  std::vector<double> t1(sh.C, 0.0), t2(sh.C, 0.0);
  for (size_t i = 0; i < items.size(); ++i) {
    for (int64_t j = 0; j < items[i].w; ++j) {
      t1[items[i].c0 + j] += part_dy[slot[i] + j];
      t2[items[i].c0 + j] += part_dyx[slot[i] + j];
    }
  }
  for (int64_t c = 0; c < sh.C; ++c) {
    sum_dy_out[c] = static_cast<float>(t1[c]);
    sum_dy_xmu_out[c] = static_cast<float>(t2[c]);
  }
}

// out = p*a + q*(x - mean) + r per channel, where a is dy (backward) or unused
// (forward, p = 0). Coefficients are float32 arrays of C.
template <typename T, bool kHasA>
void affine_kernel(const T* a, const T* x, T* out, const BnShape& sh, const float* mean, const float* p,
                   const float* q, const float* r) {
  constexpr int64_t kSpan = 512;
  const int64_t total = sh.N * sh.C * sh.S;
  if (total == 0) return;
  if (sh.layout == BnLayout::NCS) {
    // Rows of S elements, one channel per row.
    const int64_t rows = sh.N * sh.C;
    const int64_t grain = std::max<int64_t>(1, kItem / std::max<int64_t>(sh.S, 1));
    parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
      alignas(64) float fa[kSpan];
      alignas(64) float fx[kSpan];
      for (int64_t row = b; row < e; ++row) {
        const int64_t c = row % sh.C;
        // p is null without a (forward): read only when there is one.
        const Vec vm(mean[c]), vp(kHasA ? p[c] : 0.f), vq(q[c]), vr(r[c]);
        for (int64_t s0 = 0; s0 < sh.S; s0 += kSpan) {
          const int64_t len = std::min(kSpan, sh.S - s0);
          const int64_t off = row * sh.S + s0;
          to_float(x + off, fx, len);
          if constexpr (kHasA) to_float(a + off, fa, len);
          for (int64_t i = 0; i < len; i += kVS) {
            Vec v = at::vec::fmadd(vq, Vec::loadu(fx + i) - vm, vr);
            if constexpr (kHasA) v = at::vec::fmadd(vp, Vec::loadu(fa + i), v);
            v.store(fx + i);  // buffers hold kSpan floats: full-width stores stay inside
          }
          at::vec::convert(fx, out + off, len);
        }
      }
    });
  } else {
    const int64_t rows = sh.N * sh.S;
    const int64_t grain = std::max<int64_t>(1, kItem / sh.C);
    parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
      alignas(64) float fa[kSpan];
      alignas(64) float fx[kSpan];
      for (int64_t row = b; row < e; ++row) {
        for (int64_t c0 = 0; c0 < sh.C; c0 += kSpan) {
          const int64_t len = std::min(kSpan, sh.C - c0);
          const int64_t off = row * sh.C + c0;
          to_float(x + off, fx, len);
          if constexpr (kHasA) to_float(a + off, fa, len);
          int64_t i = 0;
          for (; i + kVS <= len; i += kVS) {
            const int64_t c = c0 + i;
            Vec v = at::vec::fmadd(Vec::loadu(q + c), Vec::loadu(fx + i) - Vec::loadu(mean + c), Vec::loadu(r + c));
            if constexpr (kHasA) v = at::vec::fmadd(Vec::loadu(p + c), Vec::loadu(fa + i), v);
            v.store(fx + i);
          }
          for (; i < len; ++i) {
            const int64_t c = c0 + i;
            float v = q[c] * (fx[i] - mean[c]) + r[c];
            if constexpr (kHasA) v += p[c] * fa[i];
            fx[i] = v;
          }
          at::vec::convert(fx, out + off, len);
        }
      }
    });
  }
}

}  // namespace

void bn_stats_cpu(const at::Tensor& x, const BnShape& shape, const at::Tensor& mean, const at::Tensor& m2) {
  float* mp = mean.data_ptr<float>();
  float* qp = m2.data_ptr<float>();
  std::fill(mp, mp + shape.C, 0.f);
  std::fill(qp, qp + shape.C, 0.f);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bn_stats_cpu", [&] {
    stats_kernel<scalar_t>(x.const_data_ptr<scalar_t>(), shape, mp, qp);
  });
}

void bn_backward_reduce_cpu(const at::Tensor& dy, const at::Tensor& x, const BnShape& shape, const at::Tensor& mean,
                            const at::Tensor& sum_dy, const at::Tensor& sum_dy_xmu) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bn_backward_reduce_cpu", [&] {
    backward_reduce_kernel<scalar_t>(dy.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
                                     mean.const_data_ptr<float>(), shape, sum_dy.data_ptr<float>(),
                                     sum_dy_xmu.data_ptr<float>());
  });
}

void bn_elemt_cpu(const at::Tensor& x, const BnShape& shape, const at::Tensor& mean, const at::Tensor& invstd,
                  const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& out) {
  // y = invstd*w * (x - mean) + b
  const int64_t C = shape.C;
  std::vector<float> q(C), r(C);
  const float* is = invstd.const_data_ptr<float>();
  const float* w = weight.defined() ? weight.const_data_ptr<float>() : nullptr;
  const float* b = bias.defined() ? bias.const_data_ptr<float>() : nullptr;
  for (int64_t c = 0; c < C; ++c) {
    q[c] = w ? is[c] * w[c] : is[c];
    r[c] = b ? b[c] : 0.f;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bn_elemt_cpu", [&] {
    affine_kernel<scalar_t, false>(nullptr, x.const_data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), shape,
                                   mean.const_data_ptr<float>(), nullptr, q.data(), r.data());
  });
}

void bn_backward_elemt_cpu(const at::Tensor& dy, const at::Tensor& x, const BnShape& shape, const at::Tensor& mean,
                           const at::Tensor& invstd, const at::Tensor& weight, const at::Tensor& sum_dy,
                           const at::Tensor& sum_dy_xmu, const at::Tensor& count, const at::Tensor& dx) {
  // dx = invstd*w * (dy - sum_dy/n - (x - mean) * invstd^2 * sum_dy_xmu/n)
  const int64_t C = shape.C;
  std::vector<float> p(C), q(C), r(C);
  const float* is = invstd.const_data_ptr<float>();
  const float* w = weight.defined() ? weight.const_data_ptr<float>() : nullptr;
  const float* sd = sum_dy.const_data_ptr<float>();
  const float* sdx = sum_dy_xmu.const_data_ptr<float>();
  const double n = static_cast<double>(*count.const_data_ptr<float>());
  const double inv_n = n > 0.0 ? 1.0 / n : 0.0;
  for (int64_t c = 0; c < C; ++c) {
    const double a = static_cast<double>(is[c]) * (w ? w[c] : 1.0);
    p[c] = static_cast<float>(a);
    q[c] = static_cast<float>(-a * static_cast<double>(is[c]) * is[c] * sdx[c] * inv_n);
    r[c] = static_cast<float>(-a * sd[c] * inv_n);
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bn_backward_elemt_cpu", [&] {
    affine_kernel<scalar_t, true>(dy.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
                                  dx.data_ptr<scalar_t>(), shape, mean.const_data_ptr<float>(), p.data(), q.data(),
                                  r.data());
  });
}

}  // namespace detail
}  // namespace fusetrain

// NOTE [kernel registration] in csrc/common/dispatch.h.
TORCH_LIBRARY_IMPL(fusetrain, CPU, m) {
  using namespace fusetrain::detail;
  m.impl("bn_stats", bind_kernel<&bn_stats_impl, &bn_stats_cpu>());
  m.impl("bn_backward_reduce", bind_kernel<&bn_backward_reduce_impl, &bn_backward_reduce_cpu>());
  m.impl("bn_elemt", bind_kernel<&bn_elemt_impl, &bn_elemt_cpu>());
  m.impl("bn_backward_elemt", bind_kernel<&bn_backward_elemt_impl, &bn_backward_elemt_cpu>());
}
