// Shared by every kernel body (after the backend prelude).

// Code `i` of a row of packed `B`-bit codes: stream bits [i*B, (i+1)*B), least significant first;
// stream bit j is bit j%32 of word j/32. `w` = (i*B)/32 and `sh` = (i*B)%32 are passed in because a
// thread reads the same column of many rows. Codes of 3, 5 and 6 bits may cross into word w+1.
// `row` may also be a register array indexed by compile-time constants (unrolled loops).
#define EXTRACT_CODE(row, w, sh, B) \
  ((((row)[(w)] >> (sh)) | (((sh) + (B) > 32u) ? ((row)[(w) + 1] << (32u - (sh))) : 0u)) & ((1u << (B)) - 1u))

// A code (< 2^23) as a float without the slow integer-to-float unit: the float whose bits are
// 0x4B000000 | code is exactly 2^23 + code, so one OR and one subtraction do the conversion.
FN float code_to_float(u32 code) { return AS_FLOAT(0x4B000000u | code) - 8388608.0f; }

// The bits of codes 8g .. 8g+7 of a packed row of `b`-bit codes, shifted down to bit 0.
// 8 codes span 8b <= 64 bits starting at bit 8gb, whose offset inside its word is 0, 8, 16 or 24,
// so the two words w, w+1 always hold them; w+1 is read only when the codes reach into it.
FN u64 window8(GLOBAL_CONST uint32_t* row, u32 g, u32 b) {
  const u32 bit = g * 8u * b, w = bit >> 5, sh = bit & 31u;
  const u32 lo = row[w];
  const u32 hi = (sh + 8u * b > 32u) ? row[w + 1] : 0u;
  return ((u64(hi) << 32) | u64(lo)) >> sh;
}

// Unpack those 8 codes of `B` bits (a compile-time constant) into floats c[0..7].
#define UNPACK8(row, g, B, c) { \
  const u64 win_ = window8((row), (g), u32(B)); \
  UNROLL for (int e_ = 0; e_ < 8; ++e_) (c)[e_] = code_to_float(u32(win_ >> (e_ * (B))) & ((1u << (B)) - 1u)); }

// Online softmax: the factor that rescales sums kept under the old maximum, and one weight.
// Both are -inf safe: nothing seen yet (m_old = -inf) or a masked score (s = -inf) give 0.
FN float rescale_factor(float m_old, float m_new) { return (m_old == NEG_INF) ? 0.0f : exp(m_old - m_new); }
FN float softmax_weight(float s, float m) { return (s == NEG_INF) ? 0.0f : exp(s - m); }
FN float clip_f(float x, float lo, float hi) { return fmin(fmax(x, lo), hi); }   // as mx.clip

// The unnormalized Walsh-Hadamard transform of `rows` rows of `d` floats (a power of two) in threadgroup
// memory, by log2(d) butterfly stages x[i], x[i ^ h] -> x[i] + x[i ^ h], x[i] - x[i ^ h], shared by the
// `threads` threads of the group (this one: tid). A barrier comes before each stage, none after the last.
FN void hadamard_rows(SHARED_PTR float* x, u32 rows, u32 d, u32 tid, u32 threads) {
  for (u32 h = 1; h < d; h <<= 1) {
    BARRIER();
    for (u32 i = tid; i < rows * d / 2u; i += threads) {
      const u32 j = i / (d / 2u), k = i % (d / 2u);
      const u32 lo = j * d + (k / h) * 2u * h + k % h, hi = lo + h;
      const float a = x[lo], b = x[hi];
      x[lo] = a + b;
      x[hi] = a - b;
    }
  }
}

// The split kernels' own merge (MERGE = 1: the last threadgroup of a (kv head, query chunk)): for each of its
// ROWS query vectors j (query row j0 + j; rows past NQ are left unwritten) and channels d, sum_i w_ij o_ij over the
// nsplit partials with w_ij = exp(lse_ij - top[j]) / den[j], the first nrot splits into rot[j D + d] and the
// others into plain[j D + d] (or all into rot where plain is rot). One threadgroup runs this tail alone after
// the others of its kernel end, so it is a chain of loads: a thread takes 4 channels of a row as one 16-byte load
// and loads DEPTH splits of them before adding any. DEPTH costs registers (5 a split): kvarn_decode's are capped
// anyway and it takes 16; affine_decode's set its occupancy, and 16 takes it from 96 to 128
// (docs/history/gpu-rounds.md).
// D: a multiple of 4.
template <int D, int ROWS, int THREADS, int DEPTH>
FN void merge_partials(GLOBAL_CONST float* lse_all, GLOBAL_CONST float* o_all, int NQ, int j0, int nsplit, int nrot,
                       SHARED_PTR const float* top, SHARED_PTR const float* den, SHARED_PTR float* rot,
                       SHARED_PTR float* plain, u32 tid) {
  for (int q = int(tid); q < ROWS * D / 4; q += THREADS) {   // q: channels 4q .. 4q + 3 of the ROWS x D outputs
    const int j = 4 * q / D, d = 4 * q % D;
    if (j0 + j >= NQ) break;   // rows only increase with q
    float4 nr = {0.0f, 0.0f, 0.0f, 0.0f}, np = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int i = 0; i < nsplit; i += DEPTH) {
      float l[DEPTH];
      float4 o[DEPTH];
      UNROLL for (int u = 0; u < DEPTH; ++u) {
        const int s = min(i + u, nsplit - 1);   // past the end: read the last split, weigh it 0
        l[u] = lse_all[s * NQ + j0 + j];
        o[u] = *(GLOBAL_CONST float4*)(o_all + (u32(s) * u32(NQ) + u32(j0 + j)) * u32(D) + u32(d));
      }
      UNROLL for (int u = 0; u < DEPTH; ++u) {
        const float w = i + u < nsplit ? softmax_weight(l[u], top[j]) : 0.0f;
        const float wr = i + u < nrot ? w : 0.0f, wp = w - wr;   // the rotated splits' share, the others'
        nr.x += wr * o[u].x; nr.y += wr * o[u].y; nr.z += wr * o[u].z; nr.w += wr * o[u].w;
        np.x += wp * o[u].x; np.y += wp * o[u].y; np.z += wp * o[u].z; np.w += wp * o[u].w;
      }
    }
    const float inv = den[j] > 0.0f ? 1.0f / den[j] : 0.0f;
    const float4 sum = {nr.x + np.x, nr.y + np.y, nr.z + np.z, nr.w + np.w};
    const float4 r4 = plain != rot ? nr : sum;
    rot[j * D + d] = r4.x * inv; rot[j * D + d + 1] = r4.y * inv; rot[j * D + d + 2] = r4.z * inv; rot[j * D + d + 3] = r4.w * inv;
    if (plain != rot) {
      plain[j * D + d] = np.x * inv; plain[j * D + d + 1] = np.y * inv; plain[j * D + d + 2] = np.z * inv; plain[j * D + d + 3] = np.w * inv;
    }
  }
}
