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
