// ap_ew_c85e0dd04d42c2d3 grid [1, 1, 1] block [256, 1, 1]
struct __align__(16) ap_ew_c85e0dd04d42c2d3_pv0 { int v[4]; };
struct __align__(16) ap_ew_c85e0dd04d42c2d3_rv0 { int v[4]; };
extern "C" __global__ void __launch_bounds__(256) ap_ew_c85e0dd04d42c2d3(const int* __restrict__ p0, int* __restrict__ r0) {
  const ap_i64 n = 10ll;
  const ap_i64 n_vec = n / 4ll;
  const ap_i64 stride = (ap_i64)gridDim.x * blockDim.x;
  for (ap_i64 w = (ap_i64)blockIdx.x * blockDim.x + threadIdx.x; w < n_vec; w += stride) {
    const ap_ew_c85e0dd04d42c2d3_pv0 pv0 = *reinterpret_cast<const ap_ew_c85e0dd04d42c2d3_pv0*>(p0 + w * 4ll);
    ap_ew_c85e0dd04d42c2d3_rv0 rv0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int v1 = pv0.v[e];
      const int v2 = ap_neg32(v1);
      rv0.v[e] = v2;
    }
    *reinterpret_cast<ap_ew_c85e0dd04d42c2d3_rv0*>(r0 + w * 4ll) = rv0;
  }
  for (ap_i64 i = n_vec * 4ll + (ap_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int v1 = p0[i];
    const int v2 = ap_neg32(v1);
    r0[i] = v2;
  }
}
