// CPU replacement for prelude_cuda.h: the kernel bodies of gmlx_lab/kernels run on the CPU, one CPU thread
// (a fiber) per GPU lane, so their index math can be checked without a GPU (threads.py builds and runs them).
//
// The lanes, their warps and barriers are cpu_lanes.h's (shared with the Metal shim, shim_metal_cpu.h);
// threadIdx / blockIdx / blockDim read the running lane's. SHARED memory is `static` (one copy, shared by
// all lanes of the running block: blocks run in turn).
#pragma once

#include "cpu_lanes.h"

#define GMLX_CPU 1
#define SHARED static                            // one copy for the block's threads (blocks run in turn)
#define GLOBAL_CONST const
#define GLOBAL
#define BARRIER() gmlx_block_barrier()
#define UNROLL
#define FN inline
#define HALF _Float16
#define TO_FLOAT(x) static_cast<float>(x)
#define TO_HALF(x) static_cast<_Float16>(x)     // round to nearest even
#define AS_FLOAT(u) std::bit_cast<float>(static_cast<u32>(u))
#define NEG_INF (-std::numeric_limits<float>::infinity())
#define THREAD
#define SHARED_PTR
#define WARP_BARRIER() gmlx_warp_barrier()
#define DEVICE_FENCE() ((void)0)                 // threadgroups run one after another here
typedef unsigned int u32;
typedef unsigned long long u64;

// ---- CUDA's vector and index types ----
struct float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) uint4 { u32 x, y, z, w; };
struct Dim3 { u32 x = 0, y = 0, z = 0; };
#define threadIdx (Dim3{gmlx_tid(), 0, 0})       // the running lane's (cpu_lanes.h)
#define blockIdx (Dim3{0, gmlx_group_y, gmlx_group_z})
#define blockDim (Dim3{gmlx_block->n, 1, 1})

// ---- math (float overloads next to C's double ones) ----
FN float exp(float x) { return std::exp(x); }
FN float log(float x) { return std::log(x); }
FN float fmax(float a, float b) { return std::fmax(a, b); }
FN float fmin(float a, float b) { return std::fmin(a, b); }
FN float rsqrt(float x) { return 1.0f / std::sqrt(x); }
FN int min(int a, int b) { return a < b ? a : b; }
FN int max(int a, int b) { return a > b ? a : b; }

// ---- loads and stores of any float type ----
template <typename T> FN float load_f(T x) { return static_cast<float>(x); }
template <typename T> FN void store_f(T* p, float x) { *p = static_cast<T>(x); }

// ---- a counter written through a read-only input (threadgroups run in turn: plain operations) ----
FN u32 atomic_ticket(const u32* p) { return (*const_cast<u32*>(p))++; }
FN void atomic_reset(const u32* p) { *const_cast<u32*>(p) = 0u; }

// ---- warp shuffles and reductions ----
FN float simd_shuffle_f(float x, u32 lane) {
  const u32 w = std::bit_cast<u32>(x);
  return std::bit_cast<float>(gmlx_exchange(&w, 1)[lane & 31u][0]);
}
FN float simd_shuffle_xor_f(float x, u32 mask) { return simd_shuffle_f(x, gmlx_lane() ^ (mask & 31u)); }
FN float simd_sum_f(float x) { for (u32 o = 16; o > 0; o >>= 1) x += simd_shuffle_xor_f(x, o); return x; }
FN float simd_max_f(float x) { for (u32 o = 16; o > 0; o >>= 1) x = fmax(x, simd_shuffle_xor_f(x, o)); return x; }
FN float simd_min_f(float x) { for (u32 o = 16; o > 0; o >>= 1) x = fmin(x, simd_shuffle_xor_f(x, o)); return x; }

// ---- float16 pairs in a u32 (the smaller index in the low half) ----
FN u32 gmlx_half_bits(float x) { return std::bit_cast<uint16_t>(static_cast<_Float16>(x)); }
FN u32 pack_half2(float lo, float hi) { return gmlx_half_bits(lo) | (gmlx_half_bits(hi) << 16); }
FN u32 and_or(u32 a, u32 b, u32 c) { return (a & b) | c; }   // (CUDA: one LOP3)
// CUDA's __byte_perm without its sign-replicating mode: byte n of the result is byte (s >> 4n) & 7 of x (0..3), y (4..7)
FN u32 byte_perm(u32 x, u32 y, u32 s) {
  const u64 v = (u64(y) << 32) | u64(x);
  u32 r = 0;
  for (int n = 0; n < 4; ++n) r |= u32((v >> (8 * ((s >> (4 * n)) & 7u))) & 0xffu) << (8 * n);
  return r;
}
FN float half_bits_to_float(u32 bits) {
  return static_cast<float>(std::bit_cast<_Float16>(static_cast<uint16_t>(bits & 0xffffu)));
}

// ---- C += A B, as PTX mma.m16n8k16.row.col.f32.f16.f16.f32 (fragment layout: kvarn_decode.h) ----
// Lane 4g + t holds a[0] = A[g][2t, 2t+1], a[1] = A[g+8][2t, 2t+1], a[2] = A[g][2t+8, 2t+9],
// a[3] = A[g+8][2t+8, 2t+9]; b[0] = B[2t, 2t+1][g], b[1] = B[2t+8, 2t+9][g]; c[0] = C[g][2t],
// c[1] = C[g][2t+1], c[2] = C[g+8][2t], c[3] = C[g+8][2t+1]. Every lane gathers the whole tiles from the
// warp's exchange and computes its own four elements (float16 products are exact in float32; sums in float32).
FN void mma16816(float* c, const u32* a, const u32* b, u32 lane) {
  (void)lane;
  const u32 mine[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
  const GmlxRow* all = gmlx_exchange(mine, 6);
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, t = l & 3;
    const u32* w = all[l];
    for (int h = 0; h < 2; ++h) {   // the low (h = 0) and high (h = 1) float16 of each word
      const int sh = 16 * h;
      A[g][2 * t + h] = half_bits_to_float(w[0] >> sh);
      A[g + 8][2 * t + h] = half_bits_to_float(w[1] >> sh);
      A[g][2 * t + 8 + h] = half_bits_to_float(w[2] >> sh);
      A[g + 8][2 * t + 8 + h] = half_bits_to_float(w[3] >> sh);
      B[2 * t + h][g] = half_bits_to_float(w[4] >> sh);
      B[2 * t + 8 + h][g] = half_bits_to_float(w[5] >> sh);
    }
  }
  const int g = int(gmlx_lane() >> 2), t = int(gmlx_lane() & 3u);
  const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
  for (int i = 0; i < 4; ++i) {
    float sum = 0.0f;
    for (int k = 0; k < 16; ++k) sum += A[rows[i]][k] * B[k][cols[i]];
    c[i] += sum;
  }
}

// CUDA's L2 prefetch hint: nothing to do on the CPU (it changes no value a kernel computes).
template <typename T> FN void prefetch_l2(const T*, u32, u32, u32) {}

// ---- asynchronous copies (CUDA's cp.async), done late on purpose ----
// Each lane keeps its copies in groups; a copy happens only when the lane waits for its group (async_wait), never
// when it is issued, so a body that reads a slot before waiting, or before the other lanes have waited
// (WARP_BARRIER), reads stale words here as it could on a GPU.
struct GmlxCopy { u32* dst; const u32* src; int words; };
struct GmlxCopyGroups { std::vector<std::vector<GmlxCopy>> groups{1}; };   // the last one is still open
inline GmlxCopyGroups gmlx_copies[1024];   // per lane of the running threadgroup
FN void gmlx_copy_later(u32* dst, const u32* src, int words) { gmlx_copies[gmlx_tid()].groups.back().push_back({dst, src, words}); }
FN void async_copy16(u32* dst, const u32* src) { gmlx_copy_later(dst, src, 4); }
FN void async_copy4(u32* dst, const u32* src) { gmlx_copy_later(dst, src, 1); }
FN void async_commit() { gmlx_copies[gmlx_tid()].groups.emplace_back(); }
template <int N> FN void async_wait() {
  auto& groups = gmlx_copies[gmlx_tid()].groups;   // committed groups: all but the open last one
  while (groups.size() - 1 > size_t(N)) {
    for (const GmlxCopy& c : groups.front()) std::memcpy(c.dst, c.src, 4 * size_t(c.words));
    groups.erase(groups.begin());
  }
}

// ---- the launch: blocks (y, z) in turn, each as `threads` lanes calling block_fn() ----
template <typename F>
bool gmlx_launch(u32 grid_y, u32 grid_z, u32 threads, F block_fn) {
  return gmlx_run_lanes(grid_y, grid_z, threads, [&](u32, u32, u32) { block_fn(); });
}
