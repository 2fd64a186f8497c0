// Linear layers of few rows on the CPU over the project's own packed weight: y = x @ W^T (+ bias), float32.
//
// Why: a decode step multiplies one to a few rows by every weight of the model, so it is bound by reading the
// weights.  oneDNN's packed product (engine/model/cpu_packing.py) costs tens of microseconds a call beyond that
// read and reads its layout below stream speed at these rows; a small model's step is 33 calls.  Here a call is
// one parallel pass over the weight, read once at stream speed (docs/decisions/cpu-linear.md).  Many rows (a
// prefill) stay on oneDNN, whose blocking is better there.
//
// Layout: W [N, K] packed as panels of 32 output features, [ceil(N / 32)][K][32] (zero rows past N).  A step of k
// loads two vectors of a panel and multiplies them by each row's x[k], broadcast: no horizontal sums, any K.
// Numbers: each output is summed over k in a fixed order (blocks of kKBlock in turn, each in k order, fused
// multiply-adds), the same whatever the number of rows or threads.

#pragma GCC optimize("fp-contract=fast")

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

typedef float vec16 __attribute__((vector_size(64), aligned(4)));  // unaligned loads and stores allowed

constexpr int kVectors = 2;                 // 16-float vectors per panel
constexpr int64_t kPanel = 16 * kVectors;  // output features per panel
constexpr int64_t kKBlock = 512;  // k per block: a row tile past the first reads the panel's block from L1 or L2
#if defined(__AVX512F__)
constexpr int kRowTile = 12;  // 12 rows x 2 vectors: 24 accumulators of 32 registers
#else
constexpr int kRowTile = 3;  // AVX2: each 16-float vector is two registers of 16
#endif

inline vec16 load(const float* p) { return *reinterpret_cast<const vec16*>(p); }
inline void store(float* p, vec16 v) { *reinterpret_cast<vec16*>(p) = v; }

// R rows of x (row stride ldx) times one panel's k in [k0, k1); adds into out (or writes it, `first`) for the
// panel's `cols` valid features.  R is a template argument so that the accumulators stay in registers.
template <int R>
inline void tile(const float* x, int64_t ldx, int64_t kstride, const float* panel, int64_t k0, int64_t k1,
                 float* out, int64_t ldo, int64_t cols, bool first) {
  vec16 acc[R][kVectors];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < kVectors; ++v) acc[r][v] = vec16{};
  }
  for (int64_t k = k0; k < k1; ++k) {
    vec16 w[kVectors];
#pragma GCC unroll 4
    for (int v = 0; v < kVectors; ++v) w[v] = load(panel + k * kPanel + 16 * v);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * ldx + k * kstride];
#pragma GCC unroll 4
      for (int v = 0; v < kVectors; ++v) acc[r][v] += xv * w[v];
    }
  }
  for (int r = 0; r < R; ++r) {
    float* o = out + r * ldo;
    if (cols == kPanel) {
#pragma GCC unroll 4
      for (int v = 0; v < kVectors; ++v) store(o + 16 * v, first ? acc[r][v] : load(o + 16 * v) + acc[r][v]);
    } else {  // the last panel of a layer whose N is no multiple of the panel
      float part[kPanel];
      for (int v = 0; v < kVectors; ++v) store(part + 16 * v, acc[r][v]);
      for (int64_t c = 0; c < cols; ++c) o[c] = first ? part[c] : o[c] + part[c];
    }
  }
}

template <int R>
void tile_dispatch(int rows, const float* x, int64_t ldx, int64_t kstride, const float* panel, int64_t k0,
                   int64_t k1, float* out, int64_t ldo, int64_t cols, bool first) {
  if constexpr (R > 1) {
    if (rows < R) return tile_dispatch<R - 1>(rows, x, ldx, kstride, panel, k0, k1, out, ldo, cols, first);
  }
  tile<R>(x, ldx, kstride, panel, k0, k1, out, ldo, cols, first);
}

// Panels [p0, p1) for all rows: k blocks outermost, so a panel's block is read from memory once and reused from
// L1 by every tile of rows.
void panels(const float* x, bool x_tiled, int64_t rows, int64_t ldx, int64_t k, const float* packed, int64_t n,
            const float* bias, float* out, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const float* panel = packed + p * k * kPanel;
    const int64_t cols = std::min(kPanel, n - p * kPanel);
    float* o = out + p * kPanel;
    for (int64_t k0 = 0; k0 < k; k0 += kKBlock) {
      const int64_t k1 = std::min(k, k0 + kKBlock);
      for (int64_t r = 0; r < rows; r += kRowTile) {
        const int tile_rows = static_cast<int>(std::min<int64_t>(kRowTile, rows - r));
        if (x_tiled) {  // [tiles][K][kRowTile]: a step of k reads kRowTile consecutive floats
          tile_dispatch<kRowTile>(tile_rows, x + r * k, 1, kRowTile, panel, k0, k1, o + r * n, n, cols, k0 == 0);
        } else {
          tile_dispatch<kRowTile>(tile_rows, x + r * ldx, ldx, 1, panel, k0, k1, o + r * n, n, cols, k0 == 0);
        }
      }
    }
    if (bias != nullptr) {
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) o[r * n + c] += bias[p * kPanel + c];
      }
    }
  }
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                         const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat,
              "x must be float32 [rows, K] with contiguous rows");
  const int64_t rows = x.size(0), k = x.size(1), num_panels = (n + kPanel - 1) / kPanel;
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kFloat &&
                  packed.size(0) == num_panels && packed.size(1) == k && packed.size(2) == kPanel,
              "packed must be contiguous float32 [ceil(N / 32), K, 32] for x's K");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->is_contiguous() && bias->size(0) == n && bias->scalar_type() == at::kFloat,
                "bias must be contiguous float32 [N]");
    bp = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  // More rows than one tile: x is copied into tiles of kRowTile rows, interleaved by k ([tiles][K][kRowTile],
  // zeros past the last row), so that each tile's step reads one run of memory instead of kRowTile rows' lines.
  at::Tensor tiled;
  const bool x_tiled = rows > kRowTile;
  if (x_tiled) {
    const int64_t tiles = (rows + kRowTile - 1) / kRowTile;
    tiled = at::zeros({tiles, k, kRowTile}, x.options());
    float* tp = tiled.data_ptr<float>();
    at::parallel_for(0, tiles, 1, [=](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t r1 = std::min(rows, (t + 1) * kRowTile);
        for (int64_t r = t * kRowTile; r < r1; ++r) {
          const float* src = xp + r * ldx;
          float* dst = tp + t * k * kRowTile + (r - t * kRowTile);
          for (int64_t i = 0; i < k; ++i) dst[i * kRowTile] = src[i];
        }
      }
    });
    xp = tp;
  }
  // grain: about 64 K floats of weight per thread at least, so a small layer does not open a parallel region
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, k * kPanel));
  at::parallel_for(0, num_panels, grain, [=](int64_t p0, int64_t p1) {
    panels(xp, x_tiled, rows, ldx, k, wp, n, bp, op, p0, p1);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagekeeper_cpu, m) {
  m.def("packed_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagekeeper_cpu, CPU, m) { m.impl("packed_linear", &packed_linear); }
