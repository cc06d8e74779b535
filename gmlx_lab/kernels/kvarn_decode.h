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
// `row` points into device memory, or (PF 3) into a ring slot in threadgroup memory.
template <int B, typename P>
FN void load_codes16(P row, u32 g, THREAD u32* w) {
  constexpr int NW = (B + 1) / 2;
  const u32 bit = g * 16u * u32(B);
  const P p = row + (bit >> 5);
  u32 raw[NW + 1];
  UNROLL for (int i = 0; i < NW; ++i) raw[i] = p[i];
  raw[NW] = 0u;
  const bool half_word = (bit & 31u) != 0u;  // only for odd B and odd g
  UNROLL for (int i = 0; i < NW; ++i) w[i] = half_word ? ((raw[i] >> 16) | (raw[i + 1] << 16)) : raw[i];
}

// The code words of four packed rows (each as load_codes16: codes 16g .. 16g+15) into w[0 .. 4 NW).
template <int B, typename P>
FN void load_rows4(P codes, int r0, int r1, int r2, int r3, u32 g, THREAD u32* w) {
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

// ---- PF 3: a ring of chunks staged through threadgroup memory by asynchronous copies ----
// A warp consumes its records' chunks in one order: per record, for each slice its 8 K chunks (16 channels),
// then for each slice its 8 V chunks (16 tokens); chunk i of the warp's run is record u_begin + i / (16 S).
// Each warp owns NST slots and keeps the next NST - 1 chunks in flight while it multiplies one, so more bytes
// are on their way per warp without more registers (the copies land in threadgroup memory, not registers).
// A slot: 16 code rows of B bits (4B words each), then 16 factor words. Slot row 4e + t holds the e-th of the
// four rows lane quad t reads (load_rows4's r0 .. r3), so the four quads' rows are consecutive and the
// 6-bit reads of one instruction fall in 32 different banks.
//   K chunk ch: e-th row of quad t is channel 16 ch + 2t + (e & 1) + 8 (e >> 1); factor words j, 8 + j
//               (j < 8) are the ks, kz pairs of channels 16 ch + 2j, +1 (quad t reads pairs t and t + 4).
//   V chunk ch: e-th row of quad t is token 32t + 2ch + 16 (e & 1) + (e >> 1); factor words j, 8 + j are the
//               vs, vz pairs of tokens x, x + 1 with x = 32 (j >> 1) + 2 ch + 16 (j & 1) (quad t: 2t, 2t + 1).
FN int ring_row(bool v, int ch, int j) {
  const int e = j >> 2, t = j & 3;
  return v ? 32 * t + 2 * ch + 16 * (e & 1) + (e >> 1) : 16 * ch + 2 * t + (e & 1) + 8 * (e >> 1);
}

// Start the copies of one chunk (record slice rs, V or K, chunk ch) into `slot`, shared by the warp's lanes;
// FOFF: where the slot's factor words begin.
template <int B, int FOFF>
FN void stage_chunk(GLOBAL_CONST uint32_t* codes, GLOBAL_CONST HALF* scale, GLOBAL_CONST HALF* zero, u32 rs, bool v,
                    int ch, SHARED_PTR u32* slot, u32 lane) {
  for (int p = int(lane); p < 16 * B; p += 32) {   // 16-byte pieces: piece k of slot row j
    const int j = p / B, k = p % B;
    async_copy16(slot + j * 4 * B + 4 * k, codes + (rs * 128u + u32(ring_row(v, ch, j))) * u32(4 * B) + u32(4 * k));
  }
  if (lane < 16u) {
    const int j = int(lane & 7u);
    GLOBAL_CONST u32* f = (GLOBAL_CONST u32*)(lane < 8u ? scale : zero) + rs * 64u;
    const int pair = v ? 16 * (j >> 1) + ch + 8 * (j & 1) : 8 * ch + j;
    async_copy4(slot + FOFF + int(lane), f + pair);
  }
}

// Start chunk i of the warp's run into `slot`.
template <int KB, int VB, int S, int FOFF>
FN void stage_next(GLOBAL_CONST uint32_t* kc, GLOBAL_CONST HALF* ks, GLOBAL_CONST HALF* kz, GLOBAL_CONST uint32_t* vc,
                   GLOBAL_CONST HALF* vs, GLOBAL_CONST HALF* vz, u32 bh, int R, int u_begin, int i,
                   SHARED_PTR u32* slot, u32 lane) {
  const int n = i % (16 * S);
  const int s = (n % (8 * S)) / 8, ch = n % 8;
  const u32 rs = (bh * u32(R) + u32(u_begin + i / (16 * S))) * u32(S) + u32(s);
  if (n >= 8 * S) stage_chunk<VB, FOFF>(vc, vs, vz, rs, true, ch, slot, lane);
  else stage_chunk<KB, FOFF>(kc, ks, kz, rs, false, ch, slot, lane);
}

// The slot of chunk `next` (then counted on), once every lane's copies into it have landed. First the chunk
// NST - 1 further on starts into the slot the previous chunk was read from, once every lane is done reading it.
template <int KB, int VB, int S, int FOFF, int NST, int SLOT>
FN SHARED_PTR const u32* ring_advance(GLOBAL_CONST uint32_t* kc, GLOBAL_CONST HALF* ks, GLOBAL_CONST HALF* kz,
                                      GLOBAL_CONST uint32_t* vc, GLOBAL_CONST HALF* vs, GLOBAL_CONST HALF* vz, u32 bh,
                                      int R, int u_begin, int chunks, THREAD int& next, SHARED_PTR u32* ring, u32 lane) {
  const int i = next + NST - 1;
  WARP_BARRIER();
  if (i < chunks) stage_next<KB, VB, S, FOFF>(kc, ks, kz, vc, vs, vz, bh, R, u_begin, i, ring + (i % NST) * SLOT, lane);
  async_commit();
  async_wait<NST - 1>();   // all but the newest NST - 1 groups (chunks next + 1 ..): chunk `next` has landed
  WARP_BARRIER();
  return ring + (next++ % NST) * SLOT;
}
