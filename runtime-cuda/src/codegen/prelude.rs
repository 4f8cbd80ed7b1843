//! The CUDA C every generated kernel starts with: storage types for the IR's dtypes and the
//! conversions and functions whose semantics must match the reference interpreter.
//!
//! It is self-contained (no `cuda_fp16.h`/`cuda_bf16.h`: the NVRTC wheel ships neither):
//! bf16 is converted with bit arithmetic (round to nearest even, NaN kept quiet), f16 with the
//! PTX `cvt` instructions, which round to nearest even too. Every float computes in `float`.

/// The prelude's text.
pub const PRELUDE: &str = r#"// autopar generated kernel. Storage: f32 float, f16/bf16 unsigned short, i32 int,
// i64 long long, bool unsigned char. Compute: float (f32 accumulation).
typedef unsigned short ap_f16;
typedef unsigned short ap_bf16;
typedef unsigned char ap_bool;
typedef long long ap_i64;
typedef unsigned long long ap_u64;

__device__ __forceinline__ float ap_bf16_to_f32(ap_bf16 x) {
  return __uint_as_float(((unsigned int)x) << 16);
}
__device__ __forceinline__ ap_bf16 ap_f32_to_bf16(float x) {
  unsigned int u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (ap_bf16)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (ap_bf16)(u >> 16);
}
__device__ __forceinline__ float ap_f16_to_f32(ap_f16 x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
  return f;
}
__device__ __forceinline__ ap_f16 ap_f32_to_f16(float x) {
  ap_f16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
  return h;
}
__device__ __forceinline__ float ap_round_bf16(float x) { return ap_bf16_to_f32(ap_f32_to_bf16(x)); }
__device__ __forceinline__ float ap_round_f16(float x) { return ap_f16_to_f32(ap_f32_to_f16(x)); }

__device__ __forceinline__ float ap_sigmoid(float x) {
  if (x >= 0.0f) return 1.0f / (1.0f + expf(-x));
  float e = expf(x);
  return e / (1.0f + e);
}
__device__ __forceinline__ float ap_gelu(float x) {
  return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}
__device__ __forceinline__ float ap_gelu_grad(float x) {
  float t = tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x));
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * 0.7978845608028654f * (1.0f + 0.134145f * x * x);
}
__device__ __forceinline__ float ap_gelu_erf(float x) {
  return 0.5f * x * (1.0f + erff(x * 0.7071067811865476f));
}
__device__ __forceinline__ float ap_relu(float x) { return x < 0.0f ? 0.0f : x; }
// Max and min as the reference defines them: a NaN operand gives NaN.
__device__ __forceinline__ float ap_fmax(float a, float b) { return (isnan(a) || a > b) ? a : b; }
__device__ __forceinline__ float ap_fmin(float a, float b) { return (isnan(a) || a < b) ? a : b; }
// Reductions keep the first NaN they meet.
__device__ __forceinline__ float ap_rmax(float a, float b) { return (isnan(a) || a >= b) ? a : b; }
__device__ __forceinline__ float ap_rmin(float a, float b) { return (isnan(a) || a <= b) ? a : b; }
// Integers wrap on overflow (two's complement), as the reference does.
__device__ __forceinline__ ap_i64 ap_add64(ap_i64 a, ap_i64 b) { return (ap_i64)((ap_u64)a + (ap_u64)b); }
__device__ __forceinline__ ap_i64 ap_sub64(ap_i64 a, ap_i64 b) { return (ap_i64)((ap_u64)a - (ap_u64)b); }
__device__ __forceinline__ ap_i64 ap_mul64(ap_i64 a, ap_i64 b) { return (ap_i64)((ap_u64)a * (ap_u64)b); }
__device__ __forceinline__ ap_i64 ap_neg64(ap_i64 a) { return (ap_i64)(0ull - (ap_u64)a); }
__device__ __forceinline__ ap_i64 ap_abs64(ap_i64 a) { return a < 0 ? ap_neg64(a) : a; }
// Truncating division; MIN / -1 wraps. Division by zero gives 0 (the reference stops with
// an error instead).
__device__ __forceinline__ ap_i64 ap_div64(ap_i64 a, ap_i64 b) {
  return b == 0 ? 0 : (b == -1 ? ap_neg64(a) : a / b);
}
__device__ __forceinline__ int ap_add32(int a, int b) { return (int)((unsigned int)a + (unsigned int)b); }
__device__ __forceinline__ int ap_sub32(int a, int b) { return (int)((unsigned int)a - (unsigned int)b); }
__device__ __forceinline__ int ap_mul32(int a, int b) { return (int)((unsigned int)a * (unsigned int)b); }
__device__ __forceinline__ int ap_neg32(int a) { return (int)(0u - (unsigned int)a); }
__device__ __forceinline__ int ap_abs32(int a) { return a < 0 ? ap_neg32(a) : a; }
__device__ __forceinline__ int ap_div32(int a, int b) {
  return b == 0 ? 0 : (b == -1 ? ap_neg32(a) : a / b);
}
// Float to integer truncates toward zero, saturating, NaN giving 0 (PTX cvt.rzi semantics).
__device__ __forceinline__ int ap_f2i32(float x) { return __float2int_rz(x); }
__device__ __forceinline__ ap_i64 ap_f2i64(float x) { return __float2ll_rz(x); }

// Warp and block reductions over float partials (a block of at most 1024 threads).
#define AP_WARP_REDUCE(T, v, COMBINE)                                   \
  for (int ap_o = 16; ap_o > 0; ap_o >>= 1) {                           \
    T ap_other = __shfl_xor_sync(0xffffffffu, v, ap_o);                 \
    v = COMBINE(v, ap_other);                                           \
  }
__device__ __forceinline__ float ap_sum(float a, float b) { return a + b; }
__device__ __forceinline__ int ap_sum32(int a, int b) { return ap_add32(a, b); }
__device__ __forceinline__ ap_i64 ap_sum64(ap_i64 a, ap_i64 b) { return ap_add64(a, b); }
__device__ __forceinline__ int ap_imax32(int a, int b) { return a > b ? a : b; }
__device__ __forceinline__ int ap_imin32(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ ap_i64 ap_imax64(ap_i64 a, ap_i64 b) { return a > b ? a : b; }
__device__ __forceinline__ ap_i64 ap_imin64(ap_i64 a, ap_i64 b) { return a < b ? a : b; }
"#;
