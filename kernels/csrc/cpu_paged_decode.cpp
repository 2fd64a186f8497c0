// Decode attention over a paged KV cache on the CPU, reading every cached block where it lies.
//
// Why this exists: the torch path (kernels/cpu_backend.py) must first copy each sequence's blocks into one
// contiguous tensor per layer before torch's fused attention can read them, so every cached byte is read, written
// and read again.  Decode attention is bound by memory traffic, so reading each key and value row once, straight
// from its block, is what a CPU can gain; at 256 sequences the copy was about 40 % of a step.
//
// Layout (kernels/cpu_backend.py, "NHD"): a cache half is [num_blocks, block_size, num_kv_heads, head_dim].
// One work item is one sequence (or, when there are fewer sequences than threads can share, a slice of its KV
// heads): each token's row of keys and values is read once, front to back, for all query heads that use it
// (grouped-query attention included).  Scores are kept per block and
// folded into a running softmax (maximum, sum, weighted values), in float32 whatever the storage dtype.
// Work items are spread over torch's own intra-op threads (at::parallel_for), so the engine's thread setting
// governs this kernel too and no second thread pool competes for the cores.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "cpu_exp.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline void narrow(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void narrow(const float* src, c10::BFloat16* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::BFloat16(src[i]);  // round to nearest even, as torch does
}

inline void narrow(const float* src, c10::Half* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::Half(src[i]);
}

// One stored element as float32, inline so that the loops below vectorize with the widening folded in.
inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const c10::BFloat16* p, int64_t i) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16);
}
inline float load(const c10::Half* p, int64_t i) { return static_cast<float>(reinterpret_cast<const _Float16*>(p)[i]); }

// out[j] = q . k_j for the `m` (1..4) rows k_j = k + j * stride.  Four rows at once keep four independent sums in
// flight: one 64-wide dot alone is a chain of dependent multiply-adds, bound by their latency.
template <typename T>
inline void dots(const float* q, const T* k, int64_t stride, int64_t m, int64_t n, float* out) {
  if (m == 4) {
    const T *k0 = k, *k1 = k + stride, *k2 = k + 2 * stride, *k3 = k + 3 * stride;
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t i = 0; i < n; ++i) {
      s0 += q[i] * load(k0, i);
      s1 += q[i] * load(k1, i);
      s2 += q[i] * load(k2, i);
      s3 += q[i] * load(k3, i);
    }
    out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
    return;
  }
  for (int64_t j = 0; j < m; ++j) {
    const T* kj = k + j * stride;
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; ++i) s += q[i] * load(kj, i);
    out[j] = s;
  }
}

// y += sum_j w[j] * v_j for the `m` (1..4) rows v_j = v + j * stride: y is read and written once per four rows.
template <typename T>
inline void axpys(const float* w, const T* v, int64_t stride, int64_t m, float* y, int64_t n) {
  if (m == 4) {
    const T *v0 = v, *v1 = v + stride, *v2 = v + 2 * stride, *v3 = v + 3 * stride;
    const float w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] += w0 * load(v0, i) + w1 * load(v1, i) + w2 * load(v2, i) + w3 * load(v3, i);
    return;
  }
  for (int64_t j = 0; j < m; ++j) {
    const T* vj = v + j * stride;
    const float wj = w[j];
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] += wj * load(vj, i);
  }
}

// Prefetch `rows` rows of `width` elements (`stride` apart) of both cache halves.  Blocks are scattered, so the
// hardware's stream prefetcher restarts at every block (and every 4 KiB page) and each restart costs a miss.
template <typename T>
inline void prefetch_rows(const T* k, const T* v, int64_t rows, int64_t stride, int64_t width) {
  constexpr int64_t line = 64 / sizeof(T);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < width; i += line) {
      __builtin_prefetch(k + r * stride + i, 0, 3);
      __builtin_prefetch(v + r * stride + i, 0, 3);
    }
  }
}

using pagekeeper_cpu::exp_nonpositive;  // kernels/csrc/cpu_exp.h

// How many pieces each sequence's KV heads are cut into: one (whole token rows, read front to back) unless there
// are too few sequences to keep every thread busy, as at batch 1 with a long context.
inline int64_t head_pieces(int64_t batch, int64_t kv_heads) {
  const int64_t wanted = 4 * static_cast<int64_t>(at::get_num_threads());
  int64_t pieces = 1;
  while (batch * pieces < wanted && pieces < kv_heads) {
    int64_t next = pieces + 1;
    while (kv_heads % next != 0) ++next;
    pieces = next;
  }
  return pieces;
}

// HEAD_DIM: the head dimension when known at compile time (0: read at run time).  A constant trip count lets the
// compiler unroll the per-row loops completely; with a run-time count of 64, loop set-up and remainder handling
// cost more than the four vector iterations themselves.
template <typename T, int64_t HEAD_DIM>
void decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  const int64_t batch = query.size(0), q_heads = query.size(1), dim = HEAD_DIM ? HEAD_DIM : query.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = q_heads / kv_heads, table_width = block_tables.size(1);
  const T* q = query.data_ptr<T>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t row_stride = kv_heads * dim;  // one token's K (or V) for every KV head
  const float fscale = static_cast<float>(scale);
  const int64_t pieces = head_pieces(batch, kv_heads), piece_heads = kv_heads / pieces;
  const int64_t rows = piece_heads * group;  // query heads in one work item

  // One work item: one sequence's KV heads h0 .. h0 + piece_heads - 1 and their query heads.  Token rows are read
  // front to back (each KV head's part of a row lies next to the next one's), every row once.  Grain 1: items
  // differ in length by their sequences' contexts, so the scheduler balances them.
  at::parallel_for(0, batch * pieces, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(rows * dim), acc(rows * dim), scores(rows * block_size);
    std::vector<float> run_max(rows), run_sum(rows);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / pieces, h0 = (item % pieces) * piece_heads;
      const int64_t len = lens[b];
      const T* q_rows = q + (b * q_heads + h0 * group) * dim;  // this item's query heads are adjacent
      for (int64_t i = 0; i < rows * dim; ++i) qf[i] = load(q_rows, i) * fscale;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(run_max.begin(), run_max.end(), -std::numeric_limits<float>::infinity());
      std::fill(run_sum.begin(), run_sum.end(), 0.f);
      const int32_t* table = tables + b * table_width;
      for (int64_t start = 0; start < len; start += block_size) {
        const int64_t n = std::min(block_size, len - start);
        const int64_t base = static_cast<int64_t>(table[start / block_size]) * block_size * row_stride + h0 * dim;
        if (start + block_size < len) {  // the next block lies elsewhere: ask for it while this one is computed
          const int64_t next = static_cast<int64_t>(table[start / block_size + 1]) * block_size * row_stride + h0 * dim;
          prefetch_rows(kc + next, vc + next, std::min(block_size, len - start - block_size), row_stride,
                        piece_heads * dim);
        }
        for (int64_t t = 0; t < n; t += 4) {  // four tokens at a time: four independent sums in flight
          const int64_t m = std::min<int64_t>(4, n - t);
          const T* row = kc + base + t * row_stride;
          for (int64_t h = 0; h < piece_heads; ++h) {
            const T* k = row + h * dim;
            for (int64_t g = 0; g < group; ++g) {
              const int64_t r = h * group + g;
              dots(qf.data() + r * dim, k, row_stride, m, dim, scores.data() + r * block_size + t);
            }
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          float* s = scores.data() + r * block_size;
          float block_max = s[0];
          for (int64_t t = 1; t < n; ++t) block_max = std::max(block_max, s[t]);
          const float new_max = std::max(run_max[r], block_max);
          if (new_max > run_max[r]) {  // rescale what was summed under the old maximum
            const float shrink = std::exp(run_max[r] - new_max);
            run_sum[r] *= shrink;
            float* a = acc.data() + r * dim;
#pragma omp simd
            for (int64_t i = 0; i < dim; ++i) a[i] *= shrink;
            run_max[r] = new_max;
          }
          float total = 0.f;
#pragma omp simd reduction(+ : total)
          for (int64_t t = 0; t < n; ++t) {
            s[t] = exp_nonpositive(s[t] - new_max);
            total += s[t];
          }
          run_sum[r] += total;
        }
        for (int64_t t = 0; t < n; t += 4) {
          const int64_t m = std::min<int64_t>(4, n - t);
          const T* row = vc + base + t * row_stride;
          for (int64_t h = 0; h < piece_heads; ++h) {
            const T* v = row + h * dim;
            for (int64_t g = 0; g < group; ++g) {
              const int64_t r = h * group + g;
              axpys(scores.data() + r * block_size + t, v, row_stride, m, acc.data() + r * dim, dim);
            }
          }
        }
      }
      T* o_rows = o + (b * q_heads + h0 * group) * dim;
      for (int64_t r = 0; r < rows; ++r) {
        float* a = acc.data() + r * dim;
        const float inv = run_sum[r] > 0.f ? 1.f / run_sum[r] : 0.f;  // an empty context attends to nothing
        for (int64_t i = 0; i < dim; ++i) a[i] *= inv;
        narrow(a, o_rows + r * dim, dim);
      }
    }
  });
}

template <typename T>
void dispatch_dim(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  switch (query.size(2)) {
    case 64:
      return decode<T, 64>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
    case 128:
      return decode<T, 128>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
    default:
      return decode<T, 0>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
  }
}

void paged_decode(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out must be [batch, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must be [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "query, out and the cache halves must be contiguous");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && out.scalar_type() == query.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "query, out and the cache must share one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "block_tables and seq_lens must be contiguous int32");
  TORCH_CHECK(k_cache.size(3) == query.size(2) && query.size(1) % k_cache.size(2) == 0,
              "head_dim must match and query heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.size(0) == query.size(0) && seq_lens.size(0) == query.size(0),
              "one block-table row and one length per sequence");
  switch (query.scalar_type()) {
    case at::kFloat:
      dispatch_dim<float>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
      break;
    case at::kBFloat16:
      dispatch_dim<c10::BFloat16>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
      break;
    case at::kHalf:
      dispatch_dim<c10::Half>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
      break;
    default:
      TORCH_CHECK(false, "paged_decode: unsupported dtype ", query.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(pagekeeper_cpu, m) {
  m.def(
      "paged_decode(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(pagekeeper_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
