// exp(x) for x <= 0, shared by the CPU extension's sources (the decode kernel's softmax, SiLU's exp(-|g|)).
//
// In plain arithmetic so that it vectorizes: 2^k times a degree-7 Taylor polynomial on |r| <= ln(2)/2 (relative
// error below 1e-7, float32's own rounding).  libm's expf is scalar and took about a third of the decode kernel's
// time.  k is rounded by adding and subtracting 1.5 * 2^23: GCC does not vectorize floorf once the clamp before it
// is turned into masked operations (the decode kernel's exp loop ran scalar with floorf).

#pragma once

#include <cstdint>

namespace pagekeeper_cpu {

inline float exp_nonpositive(float x) {
  x = x > -87.0f ? x : -87.0f;  // exp(-87) ~ 1.6e-38: as good as zero beside exp(0) = 1
  const float k = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const float r = (x - k * 0.693145751953125f) - k * 1.42860682030941723212e-6f;
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  return p * __builtin_bit_cast(float, bits);
}

}  // namespace pagekeeper_cpu
