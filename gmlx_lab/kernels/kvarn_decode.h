// Helpers of kvarn_decode.body: tensor-core fragments built straight from packed codes.
//
// One warp multiplies a 16x16 float16 tile A by a 16x8 float16 tile B into 16x8 float32 accumulators
// C with `mma16816` (the prelude's; PTX mma.m16n8k16 on CUDA). Each lane holds fixed fragment
// elements; with lane = 4g + t (g = lane / 4, t = lane % 4):
//   A (rows m, cols k):  a[0] = (m=g,   k=2t, 2t+1)   a[1] = (m=g+8, k=2t, 2t+1)
//                        a[2] = (m=g,   k=2t+8, 2t+9) a[3] = (m=g+8, k=2t+8, 2t+9)
//   B (rows k, cols n):  b[0] = (k=2t, 2t+1; n=g)     b[1] = (k=2t+8, 2t+9; n=g)
//   C:                   c[0] = (m=g, n=2t)  c[1] = (m=g, n=2t+1)  c[2] = (m=g+8, n=2t)  c[3] = (m=g+8, n=2t+1)
// A u32 of A or B holds two float16 values, the smaller k in its low half.
//
// A code c < 1024 becomes the float16 1024 + c by OR-ing its bits into 0x6400 (1024 has exponent 10,
// so the 10 mantissa bits hold c exactly): two codes cost two shifts and two logic ops, no conversion.
// The products of 1024 + c with float16 B values are exact in the float32 accumulators, and the extra
// 1024 * sum_k B[k][n] is subtracted once per record (it joins the record's zero-point term).

// Words holding codes 16g .. 16g+15 of a packed row of B-bit codes, shifted so code 16g starts at bit 0
// of w[0]. 16 codes take 16B bits: B/2 words when B is even; when B is odd they start at bit 0 or 16 of
// a word and (B+1)/2 words hold them (never reaching past the row's 4B words).
template <int B>
FN void load_codes16(GLOBAL_CONST uint32_t* row, u32 g, THREAD u32* w) {
  constexpr int NW = (B + 1) / 2;
  const u32 bit = g * 16u * u32(B);
  GLOBAL_CONST uint32_t* p = row + (bit >> 5);
  u32 raw[NW + 1];
  UNROLL for (int i = 0; i < NW; ++i) raw[i] = p[i];
  raw[NW] = 0u;
  const bool half_word = (bit & 31u) != 0u;  // only for odd B and odd g
  UNROLL for (int i = 0; i < NW; ++i) w[i] = half_word ? ((raw[i] >> 16) | (raw[i + 1] << 16)) : raw[i];
}

// The code words of four packed rows (each as load_codes16: codes 16g .. 16g+15) into w[0 .. 4 NW).
template <int B>
FN void load_rows4(GLOBAL_CONST uint32_t* codes, int r0, int r1, int r2, int r3, u32 g, THREAD u32* w) {
  constexpr int NW = (B + 1) / 2;
  load_codes16<B>(codes + u32(r0) * u32(4 * B), g, w);
  load_codes16<B>(codes + u32(r1) * u32(4 * B), g, w + NW);
  load_codes16<B>(codes + u32(r2) * u32(4 * B), g, w + 2 * NW);
  load_codes16<B>(codes + u32(r3) * u32(4 * B), g, w + 3 * NW);
}

// Code j (0..15, a constant after unrolling) of the 16 held in w: bits [jB, jB + B).
template <int B>
FN u32 code16(const THREAD u32* w, int j) {
  const int bit = j * B, i = bit >> 5, sh = bit & 31;
  const u32 lo = w[i] >> sh;
  const u32 hi = (sh + B > 32) ? (w[i + 1] << (32 - sh)) : 0u;
  return (lo | hi) & ((1u << B) - 1u);
}

// float16 pair (1024 + lo, 1024 + hi) as one u32: lo in the low half.
FN u32 code_pair(u32 lo, u32 hi) { return 0x64006400u | lo | (hi << 16); }

// The A fragment of tile column block mt for four packed rows: rows r0, r1 are k = 2t, 2t+1 and rows
// r2, r3 are k = 2t+8, 2t+9; tile row m = g takes code mt of each row, m = g+8 takes code 8 + mt.
template <int B>
FN void codes_fragment(const THREAD u32* w0, const THREAD u32* w1, const THREAD u32* w2, const THREAD u32* w3,
                       int mt, THREAD u32* a) {
  a[0] = code_pair(code16<B>(w0, mt), code16<B>(w1, mt));
  a[1] = code_pair(code16<B>(w0, 8 + mt), code16<B>(w1, 8 + mt));
  a[2] = code_pair(code16<B>(w2, mt), code16<B>(w3, mt));
  a[3] = code_pair(code16<B>(w2, 8 + mt), code16<B>(w3, 8 + mt));
}

// float16 halves of two u32 words: the low halves of x and y, or their high halves, as one pair.
FN u32 low_halves(u32 x, u32 y) { return (x & 0xffffu) | (y << 16); }
FN u32 high_halves(u32 x, u32 y) { return (x >> 16) | (y & 0xffff0000u); }

// Eight words (16 float16 values) from p, which is 4-byte aligned.
FN void load_pairs8(GLOBAL_CONST HALF* p, THREAD u32* w) {
  UNROLL for (int i = 0; i < 8; ++i) w[i] = ((GLOBAL_CONST u32*)p)[i];
}

// The two float values of a float16 pair.
FN float pair_lo(u32 x) { return half_bits_to_float(x & 0xffffu); }
FN float pair_hi(u32 x) { return half_bits_to_float(x >> 16); }

// Value i (0..15) of the 16 float16 values held in w[0..8), as load_pairs8 reads them.
FN float pair_half(const THREAD u32* w, int i) { return (i & 1) ? pair_hi(w[i >> 1]) : pair_lo(w[i >> 1]); }
