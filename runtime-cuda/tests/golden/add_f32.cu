// ap_ew_145c2673a7e656cf grid [5, 1, 1] block [256, 1, 1]
struct __align__(16) ap_ew_145c2673a7e656cf_pv0 { float v[4]; };
struct __align__(16) ap_ew_145c2673a7e656cf_pv1 { float v[4]; };
struct __align__(16) ap_ew_145c2673a7e656cf_rv0 { float v[4]; };
extern "C" __global__ void __launch_bounds__(256) ap_ew_145c2673a7e656cf(const float* __restrict__ p0, const float* __restrict__ p1, float* __restrict__ r0) {
  const ap_i64 n = 4120ll;
  const ap_i64 n_vec = n / 4ll;
  const ap_i64 stride = (ap_i64)gridDim.x * blockDim.x;
  for (ap_i64 w = (ap_i64)blockIdx.x * blockDim.x + threadIdx.x; w < n_vec; w += stride) {
    const ap_ew_145c2673a7e656cf_pv0 pv0 = *reinterpret_cast<const ap_ew_145c2673a7e656cf_pv0*>(p0 + w * 4ll);
    const ap_ew_145c2673a7e656cf_pv1 pv1 = *reinterpret_cast<const ap_ew_145c2673a7e656cf_pv1*>(p1 + w * 4ll);
    ap_ew_145c2673a7e656cf_rv0 rv0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float v1 = pv0.v[e];
      const float v2 = pv1.v[e];
      const float v3 = (v1 + v2);
      rv0.v[e] = v3;
    }
    *reinterpret_cast<ap_ew_145c2673a7e656cf_rv0*>(r0 + w * 4ll) = rv0;
  }
  for (ap_i64 i = n_vec * 4ll + (ap_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float v1 = p0[i];
    const float v2 = p1[i];
    const float v3 = (v1 + v2);
    r0[i] = v3;
  }
}
