// ap_rowwarp_8c37afc93e4805c7 grid [1, 1, 1] block [256, 1, 1]
extern "C" __global__ void __launch_bounds__(256) ap_rowwarp_8c37afc93e4805c7(const ap_bf16* __restrict__ p0, ap_bf16* __restrict__ r0) {
  const ap_i64 lane = threadIdx.x & 31;
  for (ap_i64 row = (ap_i64)blockIdx.x * 8 + (threadIdx.x >> 5); row < 8ll; row += (ap_i64)gridDim.x * 8) {
    [[maybe_unused]] const ap_i64 c1 = row;
    float acc2 = __int_as_float((int)0xff800000u);
    for (ap_i64 j3 = lane; j3 < 256ll; j3 += 32) {
      [[maybe_unused]] const ap_i64 c4 = j3;
      const float v5 = ap_bf16_to_f32(p0[c1 * 256ll + c4]);
      const float v6 = v5;
      acc2 = ap_rmax(acc2, v6);
    }
    AP_WARP_REDUCE(float, acc2, ap_rmax)
    const float v7 = acc2;
    float acc8 = 0.0f;
    for (ap_i64 j9 = lane; j9 < 256ll; j9 += 32) {
      [[maybe_unused]] const ap_i64 c10 = j9;
      const float v11 = ap_bf16_to_f32(p0[c1 * 256ll + c10]);
      const float v12 = v11;
      const float v13 = (v12 - v7);
      const float v14 = expf(v13);
      acc8 = ap_sum(acc8, v14);
    }
    AP_WARP_REDUCE(float, acc8, ap_sum)
    const float v15 = acc8;
    for (ap_i64 col = lane; col < 256ll; col += 32) {
      [[maybe_unused]] const ap_i64 c16 = col;
      const float v17 = ap_bf16_to_f32(p0[c1 * 256ll + c16]);
      const float v18 = v17;
      const float v19 = (v18 - v7);
      const float v20 = expf(v19);
      const float v21 = (v20 / v15);
      const float v22 = ap_round_bf16(v21);
      r0[row * 256ll + col] = ap_f32_to_bf16(v22);
    }
  }
}
