// Helpers of kvarn_decode.body: tensor-core fragments built straight from packed codes.

// CUDA: the kernel MLX declares after this header gets launch bounds (at most KVARN_THREADS threads a block, at
// least KVARN_MIN_BLOCKS blocks a multiprocessor; decode.py defines both), which cap its registers a thread.
#if defined(GMLX_CUDA) && defined(KVARN_MIN_BLOCKS)
#undef __global__
#define __global__ __attribute__((global)) __launch_bounds__(KVARN_THREADS, KVARN_MIN_BLOCKS)
#endif
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
// `row` points into device memory, or (RING) into a ring slot in threadgroup memory.
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

// The two float values of a float16 pair.
FN float pair_lo(u32 x) { return half_bits_to_float(x & 0xffffu); }
FN float pair_hi(u32 x) { return half_bits_to_float(x >> 16); }

// ---- RING: a ring of chunks staged through threadgroup memory by asynchronous copies ----
// A warp consumes its records' chunks in one order: per record, for each slice its 8 K chunks (16 channels),
// then for each slice its 8 V chunks (16 tokens): chunk n = 8s + ch of K, 8S + 8s + ch of V. Each warp owns
// NST slots and keeps the next NST - 1 chunks in flight while it multiplies one, so more bytes are on their
// way without more registers. A chunk is 8 segments of two consecutive rows (B-bit codes, 4B words a row):
//   K chunk ch: segment j holds channels 16 ch + 2j, +1 (lane quad t reads segments t and t + 4);
//   V chunk ch: segment j holds tokens 16 j + 2 ch, +1 (quad t reads segments 2t and 2t + 1).
// In a slot, segment j starts at word j * SEGW (SEGW = 8 BMAX + 4: the 4 spare words spread the V reads of
// one instruction over all 32 banks), and 16 factor words follow at FOFF = 8 SEGW: for K words j and 8 + j
// (j < 8) are the ks and kz pairs of channels 16 ch + 2j, +1; for V the vs and vz pairs of tokens
// 32 (j >> 1) + 16 (j & 1) + 2 ch, +1. Lane (g, t) copies 16-byte pieces t, t + 4, ... of segment g.

// Start the copies of chunk n of the record whose first slice is record slice `unit` into `slot`.
template <int KB, int VB, int S, int SEGW>
FN void stage_chunk(GLOBAL_CONST uint32_t* kc, GLOBAL_CONST HALF* ks, GLOBAL_CONST HALF* kz, GLOBAL_CONST uint32_t* vc,
                    GLOBAL_CONST HALF* vs, GLOBAL_CONST HALF* vz, u32 unit, int n, SHARED_PTR u32* slot, u32 g, u32 t) {
  constexpr int FOFF = 8 * SEGW;
  const bool v = n >= 8 * S;
  const int ch = n % 8;
  const u32 rs = unit + u32((n % (8 * S)) / 8);   // the record slice
  if (v) {
    GLOBAL_CONST uint32_t* row = vc + (rs * 128u + 16u * g + u32(2 * ch)) * u32(4 * VB);
    UNROLL for (int m = 0; m < (2 * VB + 3) / 4; ++m) {
      const int w = int(t) + 4 * m;   // piece w (4 words) of the segment's 8 VB words
      if (w < 2 * VB) async_copy16(slot + g * SEGW + 4 * w, row + 4 * w);
    }
    if (g < 4u) {   // lanes 0 .. 15: word j = lane & 7 of vs (lanes 0 .. 7) or vz
      const u32 lane = 4u * g + t, j = lane & 7u;
      GLOBAL_CONST u32* f = (GLOBAL_CONST u32*)(lane < 8u ? vs : vz) + rs * 64u;
      async_copy4(slot + FOFF + lane, f + 8u * j + u32(ch));
    }
  } else {
    GLOBAL_CONST uint32_t* row = kc + (rs * 128u + u32(16 * ch) + 2u * g) * u32(4 * KB);
    UNROLL for (int m = 0; m < (2 * KB + 3) / 4; ++m) {
      const int w = int(t) + 4 * m;
      if (w < 2 * KB) async_copy16(slot + g * SEGW + 4 * w, row + 4 * w);
    }
    if (g == 0u) {   // lanes 0 .. 3: the 8 ks words (lanes 0, 1), then the 8 kz words, 4 each
      GLOBAL_CONST u32* f = (GLOBAL_CONST u32*)(t < 2u ? ks : kz) + rs * 64u;
      async_copy16(slot + FOFF + 4u * t, f + u32(8 * ch) + 4u * (t & 1u));
    }
  }
}

// The slot of chunk n of the record at record slice `unit` (the warp's current one), once every lane's copies
// into it have landed. First the chunk NST - 1 further on (in this record or, when `more`, the next) starts
// into the slot the previous chunk was read from, once every lane is done reading it. `pos`: this chunk's slot.
template <int KB, int VB, int S, int NST, int SEGW>
FN SHARED_PTR const u32* ring_advance(GLOBAL_CONST uint32_t* kc, GLOBAL_CONST HALF* ks, GLOBAL_CONST HALF* kz,
                                      GLOBAL_CONST uint32_t* vc, GLOBAL_CONST HALF* vs, GLOBAL_CONST HALF* vz,
                                      u32 unit, bool more, int n, THREAD int& pos, SHARED_PTR u32* ring, u32 g, u32 t) {
  constexpr int SLOT = 8 * SEGW + 16;
  const int ahead = n + NST - 1;
  const bool wraps = ahead >= 16 * S;   // NST - 1 < 16: at most into the next record
  WARP_BARRIER();
  if (!wraps || more)
    stage_chunk<KB, VB, S, SEGW>(kc, ks, kz, vc, vs, vz, unit + (wraps ? u32(S) : 0u), wraps ? ahead - 16 * S : ahead,
                                 ring + (pos == 0 ? NST - 1 : pos - 1) * SLOT, g, t);
  async_commit();
  async_wait<NST - 1>();   // all but the newest NST - 1 groups (the chunks after this one): this one has landed
  WARP_BARRIER();
  SHARED_PTR const u32* slot = ring + pos * SLOT;
  pos = pos + 1 == NST ? 0 : pos + 1;
  return slot;
}

// The code words of four rows of a slot, each (segment, row in it), as load_rows4 reads rows of a record.
template <int B, int SEGW>
FN void slot_rows4(SHARED_PTR const u32* slot, int s0, int r0, int s1, int r1, int s2, int r2, int s3, int r3, u32 g,
                   THREAD u32* w) {
  constexpr int NW = (B + 1) / 2;
  load_codes16<B>(slot + s0 * SEGW + r0 * 4 * B, g, w);
  load_codes16<B>(slot + s1 * SEGW + r1 * 4 * B, g, w + NW);
  load_codes16<B>(slot + s2 * SEGW + r2 * 4 * B, g, w + 2 * NW);
  load_codes16<B>(slot + s3 * SEGW + r3 * 4 * B, g, w + 3 * NW);
}
