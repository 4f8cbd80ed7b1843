// ap_permute_a06d6d1b81e1b258 grid [2, 1, 1] block [256, 1, 1]
extern "C" __global__ void __launch_bounds__(256) ap_permute_a06d6d1b81e1b258(const float* __restrict__ p0, float* __restrict__ r0) {
  const ap_i64 stride = (ap_i64)gridDim.x * blockDim.x;
  for (ap_i64 i = (ap_i64)blockIdx.x * blockDim.x + threadIdx.x; i < 384ll; i += stride) {
    const ap_i64 c0 = (i / 192ll) % 2ll;
    const ap_i64 c1 = (i / 48ll) % 4ll;
    const ap_i64 c2 = (i / 8ll) % 6ll;
    const ap_i64 c3 = (i / 1ll) % 8ll;
    r0[i] = p0[c0 * 192ll + c1 * 8ll + c2 * 32ll + c3 * 1ll];
  }
}

// ap_permute_c7efe94115fbaebc grid [2, 1, 1] block [256, 1, 1]
extern "C" __global__ void __launch_bounds__(256) ap_permute_c7efe94115fbaebc(const float* __restrict__ p0, float* __restrict__ r0) {
  const ap_i64 stride = (ap_i64)gridDim.x * blockDim.x;
  for (ap_i64 i = (ap_i64)blockIdx.x * blockDim.x + threadIdx.x; i < 320ll; i += stride) {
    const ap_i64 c0 = (i / 160ll) % 2ll;
    const ap_i64 c1 = (i / 40ll) % 4ll;
    const ap_i64 c2 = (i / 5ll) % 8ll;
    const ap_i64 c3 = (i / 1ll) % 5ll;
    r0[i] = p0[c0 * 160ll + c1 * 8ll + c2 * 1ll + c3 * 32ll];
  }
}
