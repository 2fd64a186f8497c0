// The decoder layer's small operations on the CPU, each one pass over its rows: RMSNorm (with the residual add),
// SiLU-and-multiply, rotary embedding (in place) and the KV-cache write.
//
// Why: in torch each is five to ten separate operations (kernels/reference.py), every one a dispatch, an output
// allocation and a pass over memory.  A decode step of a few sequences on a small model runs them on a few hundred
// values each, where the dispatches are the cost: on a 2-core Xeon they were a fifth of a one-sequence step, beside
// linear layers that read the whole model (docs/decisions/cpu-fused-ops.md).
//
// Numbers: each operation rounds where the torch reference rounds (to the activations' dtype after the residual
// add, after the normalization, after SiLU, after each rotary product), so a bf16 result differs from the
// reference's only where a float32 sum is ordered differently (the RMS).  Products are not contracted into fused
// multiply-adds (fp-contract=off below), as torch's own element-wise kernels do not contract them.
//
// Rows are spread over torch's intra-op threads (at::parallel_for) only when there are enough of them: below the
// grain the call runs on the calling thread and opens no parallel region.

#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "cpu_exp.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace {

constexpr int64_t kGrainElements = 1 << 15;  // elements per thread below which one thread does the whole call

inline int64_t row_grain(int64_t width) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, width)); }

// Elements are handled as their storage type (float, the bf16 bits as uint16_t, _Float16), not as c10's structs,
// which the compiler does not vectorize.
template <typename T>
struct Storage {
  using type = T;
};
template <>
struct Storage<c10::BFloat16> {
  using type = uint16_t;
};
template <>
struct Storage<c10::Half> {
  using type = _Float16;
};

inline float widen(float v) { return v; }
inline float widen(uint16_t bf16) { return __builtin_bit_cast(float, static_cast<uint32_t>(bf16) << 16); }
inline float widen(_Float16 v) { return static_cast<float>(v); }

// float32 to the storage type, rounding to nearest even as torch's casts do.
template <typename S>
inline S narrow(float v);
template <>
inline float narrow<float>(float v) {
  return v;
}
template <>
inline uint16_t narrow<uint16_t>(float v) {
  const uint32_t bits = __builtin_bit_cast(uint32_t, v);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return v != v ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(rounded);  // NaN stays a (quiet) NaN
}
template <>
inline _Float16 narrow<_Float16>(float v) {
  return static_cast<_Float16>(v);
}

template <typename T>
inline typename Storage<T>::type* raw(const at::Tensor& t) {
  return reinterpret_cast<typename Storage<T>::type*>(t.data_ptr<T>());
}

using pagekeeper_cpu::exp_nonpositive;  // kernels/csrc/cpu_exp.h

// silu(g) = g / (1 + exp(-g)), with exp taken of -|g| only (no overflow for large negative g).
inline float silu(float g) {
  const float e = exp_nonpositive(-std::fabs(g));
  const float num = g >= 0.f ? g : g * e;
  return num / (1.f + e);
}

// ---- RMSNorm ------------------------------------------------------------------------------------------------

// One row: out = w * round(v * rsqrt(mean(v^2) + eps)) with v = x, or v = round(x + r) (stored to `sum`).
template <typename S>
inline void rms_row(const S* x, const S* r, const S* w, S* out, S* sum, int64_t n, float eps) {
  float ss = 0.f;
  const S* src = x;
  if (r != nullptr) {
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; ++i) {
      const S v = narrow<S>(widen(x[i]) + widen(r[i]));
      sum[i] = v;
      const float f = widen(v);
      ss += f * f;
    }
    src = sum;
  } else {
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; ++i) {
      const float f = widen(x[i]);
      ss += f * f;
    }
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const S normed = narrow<S>(widen(src[i]) * inv);
    out[i] = narrow<S>(widen(w[i]) * widen(normed));
  }
}

template <typename T>
void rms_rows(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, double eps,
              at::Tensor& out, at::Tensor* sum_out) {
  using S = typename Storage<T>::type;
  const int64_t rows = x.size(0), n = x.size(1);
  const S* xp = raw<T>(x);
  const S* rp = residual ? raw<T>(*residual) : nullptr;
  const S* wp = raw<T>(weight);
  S* op = raw<T>(out);
  S* sp = sum_out ? raw<T>(*sum_out) : nullptr;
  const int64_t xs = x.stride(0), rs = residual ? residual->stride(0) : 0;
  const float epsf = static_cast<float>(eps);
  at::parallel_for(0, rows, row_grain(n), [=](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      rms_row<S>(xp + row * xs, rp ? rp + row * rs : nullptr, wp, op + row * n, sp ? sp + row * n : nullptr, n,
                 epsf);
    }
  });
}

template <typename F>
void by_dtype(at::ScalarType dtype, const char* op, F&& f) {
  switch (dtype) {
    case at::kFloat:
      return f(float{});
    case at::kBFloat16:
      return f(c10::BFloat16{});
    case at::kHalf:
      return f(c10::Half{});
    default:
      TORCH_CHECK(false, op, ": unsupported dtype ", dtype);
  }
}

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, what, " must be [rows, width] with contiguous rows");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be contiguous [width] in x's dtype");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  by_dtype(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    rms_rows<T>(x, nullptr, weight, eps, out, nullptr);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "residual must match x in shape and dtype");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be contiguous [width] in x's dtype");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  at::Tensor sum = at::empty({x.size(0), x.size(1)}, x.options());
  by_dtype(x.scalar_type(), "add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    rms_rows<T>(x, &residual, weight, eps, out, &sum);
  });
  return {out, sum};
}

// ---- SiLU and multiply ----------------------------------------------------------------------------------------

template <typename S>
inline void silu_mul_row(const S* g, const S* u, S* o, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const S act = narrow<S>(silu(widen(g[i])));  // silu rounded, then the product rounded, as the reference
    o[i] = narrow<S>(widen(act) * widen(u[i]));
  }
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up's width must be even ([gate | up])");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2, gs = gate_up.stride(0);
  at::Tensor out = at::empty({rows, n}, gate_up.options());
  by_dtype(gate_up.scalar_type(), "silu_mul", [&](auto tag) {
    using T = decltype(tag);
    using S = typename Storage<T>::type;
    const S* gp = raw<T>(gate_up);
    S* op = raw<T>(out);
    at::parallel_for(0, rows, row_grain(2 * n), [=](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) silu_mul_row<S>(gp + row * gs, gp + row * gs + n, op + row * n, n);
    });
  });
  return out;
}

// ---- rotary embedding (rotate-half), in place -------------------------------------------------------------------

// One head's row: the tables rounded to the storage type first (the reference's `.to(x.dtype)`), each product and
// the sum rounded.
template <typename S>
inline void rotate_row(S* row, const float* c, const float* s, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float ci = widen(narrow<S>(c[i])), si = widen(narrow<S>(s[i]));
    const float lo = widen(row[i]), hi = widen(row[i + half]);
    row[i] = narrow<S>(widen(narrow<S>(lo * ci)) + widen(narrow<S>(-hi * si)));
    row[i + half] = narrow<S>(widen(narrow<S>(hi * ci)) + widen(narrow<S>(lo * si)));
  }
}

template <typename T>
void rotate(at::Tensor& x, const int64_t* pos, const float* cos, const float* sin, int64_t table_rows) {
  using S = typename Storage<T>::type;
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  S* xp = raw<T>(x);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < table_rows, "rotary: position ", pos[t], " is outside the cos/sin tables");
  }
  at::parallel_for(0, tokens, row_grain(heads * 2 * half), [=](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + pos[t] * half;
      const float* s = sin + pos[t] * half;
      for (int64_t h = 0; h < heads; ++h) rotate_row<S>(xp + t * s0 + h * s1, c, s, half);
    }
  });
}

void rotary(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  for (const at::Tensor* t : {&q, &k}) {
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1 && t->size(2) % 2 == 0,
                "q and k must be [tokens, heads, head_dim] with contiguous, even head_dim");
  }
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.scalar_type() == k.scalar_type(),
              "q and k must share tokens, head_dim and dtype");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == q.size(0) && positions.scalar_type() == at::kLong &&
                  positions.is_contiguous(),
              "positions must be contiguous int64, one per token");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) == q.size(2) / 2 &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous(),
              "cos and sin must be contiguous float32 [positions, head_dim / 2]");
  by_dtype(q.scalar_type(), "rotary", [&](auto tag) {
    using T = decltype(tag);
    const int64_t* pos = positions.data_ptr<int64_t>();
    rotate<T>(q, pos, cos.data_ptr<float>(), sin.data_ptr<float>(), cos.size(0));
    rotate<T>(k, pos, cos.data_ptr<float>(), sin.data_ptr<float>(), cos.size(0));
  });
}

// ---- KV-cache write ----------------------------------------------------------------------------------------

// key/value [T, H, D] (token rows may be strided: views of the fused QKV output) into the cache
// [2, blocks, block_size, H, D] at slot_mapping[t] (-1: padding, skipped).  Same dtype: a copy of H * D elements.
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be contiguous [2, blocks, block_size, heads, head_dim]");
  const int64_t heads = kv_cache.size(3), d = kv_cache.size(4), width = heads * d;
  const int64_t slots = kv_cache.size(1) * kv_cache.size(2);
  for (const at::Tensor* t : {&key, &value}) {
    TORCH_CHECK(t->dim() == 3 && t->size(1) == heads && t->size(2) == d && t->stride(2) == 1 && t->stride(1) == d &&
                    t->scalar_type() == kv_cache.scalar_type(),
                "key and value must be [tokens, heads, head_dim] in the cache's dtype, each token's row contiguous");
  }
  TORCH_CHECK(key.size(0) == value.size(0) && slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0) &&
                  slot_mapping.is_contiguous() &&
                  (slot_mapping.scalar_type() == at::kLong || slot_mapping.scalar_type() == at::kInt),
              "slot_mapping must be contiguous int32 or int64, one per token");
  const int64_t tokens = key.size(0), bytes = width * kv_cache.element_size();
  auto* cache = static_cast<char*>(kv_cache.data_ptr());
  const auto* kp = static_cast<const char*>(key.data_ptr());
  const auto* vp = static_cast<const char*>(value.data_ptr());
  const int64_t ks = key.stride(0) * key.element_size(), vs = value.stride(0) * value.element_size();
  const bool wide = slot_mapping.scalar_type() == at::kLong;
  const int64_t* s64 = wide ? slot_mapping.data_ptr<int64_t>() : nullptr;
  const int32_t* s32 = wide ? nullptr : slot_mapping.data_ptr<int32_t>();
  at::parallel_for(0, tokens, row_grain(2 * width), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = wide ? s64[t] : s32[t];
      if (slot < 0) continue;
      TORCH_CHECK(slot < slots, "write_kv: slot ", slot, " is outside the cache");
      std::memcpy(cache + slot * bytes, kp + t * ks, bytes);
      std::memcpy(cache + (slots + slot) * bytes, vp + t * vs, bytes);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagekeeper_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rotary(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(pagekeeper_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rotary", &rotary);
  m.impl("write_kv", &write_kv);
}
