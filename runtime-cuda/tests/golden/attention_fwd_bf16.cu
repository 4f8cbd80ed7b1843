// ap_attn_fwd_ed1b9901c5b96917 grid [3, 4, 1] block [128, 1, 1]
extern "C" __global__ void __launch_bounds__(128) ap_attn_fwd_ed1b9901c5b96917(const ap_bf16* __restrict__ q, const ap_bf16* __restrict__ k, const ap_bf16* __restrict__ v, ap_bf16* __restrict__ o) {
  __shared__ float qs[16][32];
  __shared__ float ks[32][33];
  __shared__ float vs[32][33];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const ap_i64 bi = blockIdx.z, h = blockIdx.y, kh = h / 2;
  const ap_i64 i0 = (ap_i64)blockIdx.x * 16;
  for (int e = threadIdx.x; e < 512; e += blockDim.x) {
    const ap_i64 r = e / 32, c = e % 32, i = i0 + r;
    qs[r][c] = i < 40ll ? ap_bf16_to_f32(q[((bi * 40ll + i) * 4ll + h) * 32ll + c]) : 0.0f;
  }
  float acc[4][1];
  float m[4], l[4];
  for (int r = 0; r < 4; ++r) { m[r] = __int_as_float((int)0xff800000u); l[r] = 0.0f; for (int c = 0; c < 1; ++c) acc[r][c] = 0.0f; }
  for (ap_i64 j0 = 0; j0 < min(40ll, i0 + 16ll); j0 += 32) {
    __syncthreads();
    for (int e = threadIdx.x; e < 1024; e += blockDim.x) {
      const ap_i64 r = e / 32, c = e % 32, j = j0 + r;
      ks[r][c] = j < 40ll ? ap_bf16_to_f32(k[((bi * 40ll + j) * 2ll + kh) * 32ll + c]) : 0.0f;
    }
    for (int e = threadIdx.x; e < 1024; e += blockDim.x) {
      const ap_i64 r = e / 32, c = e % 32, j = j0 + r;
      vs[r][c] = j < 40ll ? ap_bf16_to_f32(v[((bi * 40ll + j) * 2ll + kh) * 32ll + c]) : 0.0f;
    }
    __syncthreads();
    for (int r = 0; r < 4; ++r) {
      const int lr = warp * 4 + r;
      const ap_i64 i = i0 + lr;
      const ap_i64 j = j0 + lane;
      float sc = __int_as_float((int)0xff800000u);
      if (lane < 32 && j < 40ll && i < 40ll && (j <= i)) {
        float dot = 0.0f;
        for (int c = 0; c < 32; ++c) dot += qs[lr][c] * ks[lane][c];
        sc = dot * 1.25e-1f;
      }
      float tile_max = sc;
      AP_WARP_REDUCE(float, tile_max, fmaxf)
      const float m_new = fmaxf(m[r], tile_max);
      const bool none = m_new == __int_as_float((int)0xff800000u);
      const float alpha = none ? 1.0f : expf(m[r] - m_new);
      const float p = none ? 0.0f : expf(sc - m_new);
      float p_sum = p;
      AP_WARP_REDUCE(float, p_sum, ap_sum)
      l[r] = l[r] * alpha + p_sum;
      m[r] = m_new;
      for (int c = 0; c < 1; ++c) acc[r][c] *= alpha;
      for (int jj = 0; jj < 32; ++jj) {
        const float pj = __shfl_sync(0xffffffffu, p, jj);
        for (int c = 0; c < 1; ++c) { const int col = lane + 32 * c; if (col < 32) acc[r][c] += pj * vs[jj][col]; }
      }
    }
  }
  for (int r = 0; r < 4; ++r) {
    const ap_i64 i = i0 + warp * 4 + r;
    if (i >= 40ll) continue;
    for (int c = 0; c < 1; ++c) {
      const int col = lane + 32 * c;
      if (col < 32) o[((bi * 40ll + i) * 4ll + h) * 32ll + col] = ap_f32_to_bf16(acc[r][c] / l[r]);
    }
  }
}
