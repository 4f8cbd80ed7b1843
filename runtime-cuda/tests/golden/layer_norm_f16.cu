// ap_rowblock_4d7d2da09cc9454c grid [4, 1, 1] block [512, 1, 1]
extern "C" __global__ void __launch_bounds__(512) ap_rowblock_4d7d2da09cc9454c(const ap_f16* __restrict__ p0, const ap_f16* __restrict__ p1, const ap_f16* __restrict__ p2, ap_f16* __restrict__ r0) {
  const ap_i64 lane = threadIdx.x;
  for (ap_i64 row = blockIdx.x; row < 4ll; row += gridDim.x) {
    [[maybe_unused]] const ap_i64 c1 = row;
    float acc2 = 0.0f;
    for (ap_i64 j3 = lane; j3 < 2048ll; j3 += blockDim.x) {
      [[maybe_unused]] const ap_i64 c4 = j3;
      const float v5 = ap_f16_to_f32(p0[c1 * 2048ll + c4]);
      const float v6 = v5;
      acc2 = ap_sum(acc2, v6);
    }
    AP_WARP_REDUCE(float, acc2, ap_sum)
    __shared__ float sh7[32];
    if ((threadIdx.x & 31) == 0) sh7[threadIdx.x >> 5] = acc2;
    __syncthreads();
    if (threadIdx.x < 32) {
      acc2 = threadIdx.x < (blockDim.x >> 5) ? sh7[threadIdx.x] : 0.0f;
      AP_WARP_REDUCE(float, acc2, ap_sum)
      if (threadIdx.x == 0) sh7[0] = acc2;
    }
    __syncthreads();
    acc2 = sh7[0];
    const float v8 = acc2 / 2.048e3f;
    float acc9 = 0.0f;
    for (ap_i64 j10 = lane; j10 < 2048ll; j10 += blockDim.x) {
      [[maybe_unused]] const ap_i64 c11 = j10;
      const float v12 = ap_f16_to_f32(p0[c1 * 2048ll + c11]);
      const float v13 = v12;
      const float v14 = (v13 - v8);
      const float v15 = (v14 * v14);
      acc9 = ap_sum(acc9, v15);
    }
    AP_WARP_REDUCE(float, acc9, ap_sum)
    __shared__ float sh16[32];
    if ((threadIdx.x & 31) == 0) sh16[threadIdx.x >> 5] = acc9;
    __syncthreads();
    if (threadIdx.x < 32) {
      acc9 = threadIdx.x < (blockDim.x >> 5) ? sh16[threadIdx.x] : 0.0f;
      AP_WARP_REDUCE(float, acc9, ap_sum)
      if (threadIdx.x == 0) sh16[0] = acc9;
    }
    __syncthreads();
    acc9 = sh16[0];
    const float v17 = acc9 / 2.048e3f;
    for (ap_i64 col = lane; col < 2048ll; col += blockDim.x) {
      [[maybe_unused]] const ap_i64 c18 = col;
      const float v19 = ap_f16_to_f32(p0[c1 * 2048ll + c18]);
      const float v20 = v19;
      const float v21 = (v20 - v8);
      const float v22 = (v17 + 1e-5f);
      const float v23 = (1.0f / sqrtf(v22));
      const float v24 = (v21 * v23);
      const float v25 = ap_f16_to_f32(p1[c18]);
      const float v26 = v25;
      const float v27 = (v24 * v26);
      const float v28 = ap_f16_to_f32(p2[c18]);
      const float v29 = v28;
      const float v30 = (v27 + v29);
      const float v31 = ap_round_f16(v30);
      r0[row * 2048ll + col] = ap_f32_to_f16(v31);
    }
    __syncthreads();
  }
}
