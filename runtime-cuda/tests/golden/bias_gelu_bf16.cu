// ap_loop_9679d523a8019532 grid [4, 1, 1] block [256, 1, 1]
extern "C" __global__ void __launch_bounds__(256) ap_loop_9679d523a8019532(const ap_bf16* __restrict__ p0, const ap_bf16* __restrict__ p1, ap_bf16* __restrict__ r0) {
  const ap_i64 stride = (ap_i64)gridDim.x * blockDim.x;
  for (ap_i64 i = (ap_i64)blockIdx.x * blockDim.x + threadIdx.x; i < 1024ll; i += stride) {
    [[maybe_unused]] const ap_i64 c1 = (i / 64ll);
    [[maybe_unused]] const ap_i64 c2 = (i % 64ll);
    const float v3 = ap_bf16_to_f32(p0[c1 * 64ll + c2]);
    const float v4 = ap_bf16_to_f32(p1[c2]);
    const float v5 = ap_round_bf16((v3 + v4));
    const float v6 = ap_round_bf16(ap_gelu(v5));
    r0[i] = ap_f32_to_bf16(v6);
  }
}
