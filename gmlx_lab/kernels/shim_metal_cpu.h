// Metal's names for g++ (C++20): the Metal source that mx.fast.metal_kernel compiles (sources.metal_source)
// runs on the CPU, one fiber per lane (cpu_lanes.h), over this header instead of MLX's Metal
// preamble (<metal_stdlib>, `using namespace metal;`, `typedef half float16_t;`). threads.py builds it.
//
// What each Metal name means here:
// - address spaces: `device` and `thread` are nothing. `constant` is `volatile`, so that a pointer into
//   `constant` memory cannot initialize a `device` one (the Metal compiler refuses that conversion; the other
//   direction, which Metal refuses too, passes here). `threadgroup` is nothing as a pointer qualifier; a
//   `threadgroup` variable of the kernel is made `static` by threads.py (one copy, shared by all threads of
//   the running threadgroup: threadgroups run in turn), the only rewrite of the source text besides this header.
// - attributes ([[kernel]], [[buffer(i)]], [[thread_position_in_grid]], [[host_name(...)]]) are ignored by
//   g++ (-Wno-attributes); the launcher passes each thread's indices as the kernel's arguments (MetalIds).
// - `half` is _Float16 (IEEE binary16, conversions round to nearest even); half2, float2, float4, uint3,
//   uint4 are structs with .x/.y(/.z/.w); as_type<T> is std::bit_cast (same size required, as in Metal).
// - SIMD groups are the 32-lane warps of cpu_lanes.h: simd_shuffle, simd_shuffle_xor, simd_sum, simd_max,
//   simd_min exchange the lanes' values and synchronize the group (they run in lock step at each such call);
//   simdgroup_barrier waits for the SIMD group, threadgroup_barrier for the threadgroup.
// - math: metal::exp, log, sqrt, rsqrt, floor, fmax, fmin, min, max on float (and int for min/max),
//   computed by the C++ library in IEEE float32.
// threads.py also checks the kernel's threadgroup memory against Apple's 32 KB. Not reproduced: Apple's math
// precision (its exp, log, rsqrt may differ in the last bits), its simd_sum order, lanes running concurrently
// (here they take turns), its memory model, its register limits, speed.
#pragma once

#include "cpu_lanes.h"

typedef unsigned char uchar;                       // (glibc declares the same uint, ushort and ulong)
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;                       // 64 bits, as Metal's, on 64-bit Linux and macOS
typedef _Float16 half;
typedef half float16_t;

// ---- vector types ----
struct half2 {
  half x, y;
  half2() = default;
  constexpr half2(half x_, half y_) : x(x_), y(y_) {}
};
struct alignas(8) float2 { float x, y; };       // Metal's sizes and alignments
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) uint2 { uint x, y; };
struct alignas(16) uint3 { uint x, y, z; };
struct alignas(16) uint4 { uint x, y, z, w; };

// ---- the Metal standard library's names this folder's kernels use ----
namespace metal {
template <typename T, typename U> inline T as_type(U x) { return std::bit_cast<T>(x); }

inline float exp(float x) { return std::exp(x); }
inline float log(float x) { return std::log(x); }
inline float sqrt(float x) { return std::sqrt(x); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline float floor(float x) { return std::floor(x); }
inline float fmax(float a, float b) { return std::fmax(a, b); }
inline float fmin(float a, float b) { return std::fmin(a, b); }
template <typename T> inline T min(T a, T b) { return a < b ? a : b; }
template <typename T> inline T max(T a, T b) { return a > b ? a : b; }

enum class mem_flags : unsigned { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(unsigned(a) | unsigned(b)); }
inline void threadgroup_barrier(mem_flags) { gmlx_block_barrier(); }
inline void simdgroup_barrier(mem_flags) { gmlx_warp_barrier(); }
// device atomics: threadgroups run one after another here, so plain operations
struct atomic_uint { uint value; };
enum memory_order { memory_order_relaxed };
inline uint atomic_fetch_add_explicit(atomic_uint* p, uint x, memory_order) { const uint old = p->value; p->value += x; return old; }
inline void atomic_store_explicit(atomic_uint* p, uint x, memory_order) { p->value = x; }

// Every lane's value of `x` (up to 8 bytes), after the SIMD group's exchange: all[lane][0..].
template <typename T> inline const GmlxRow* simd_values(T x) {
  static_assert(sizeof(T) <= sizeof(GmlxRow));
  uint32_t words[GmlxWarp::WORDS] = {};
  std::memcpy(words, &x, sizeof(T));
  return gmlx_exchange(words, int((sizeof(T) + 3) / 4));
}
template <typename T> inline T lane_value(const GmlxRow* all, uint32_t lane) {
  T x;
  std::memcpy(&x, all[lane & 31u], sizeof(T));   // a lane past 31 wraps (Metal leaves it undefined)
  return x;
}
template <typename T> inline T simd_shuffle(T x, ushort lane) { return lane_value<T>(simd_values(x), lane); }
template <typename T> inline T simd_shuffle_xor(T x, ushort mask) {
  return lane_value<T>(simd_values(x), gmlx_lane() ^ mask);
}
// Reductions: every lane gets the same result, summed in lane order (Apple's order is not documented).
template <typename T> inline T simd_sum(T x) {
  const GmlxRow* all = simd_values(x);
  T s = lane_value<T>(all, 0);
  for (uint32_t l = 1; l < 32; ++l) s += lane_value<T>(all, l);
  return s;
}
template <typename T> inline T simd_max(T x) {
  const GmlxRow* all = simd_values(x);
  T m = lane_value<T>(all, 0);
  for (uint32_t l = 1; l < 32; ++l) m = fmax(m, lane_value<T>(all, l));
  return m;
}
template <typename T> inline T simd_min(T x) {
  const GmlxRow* all = simd_values(x);
  T m = lane_value<T>(all, 0);
  for (uint32_t l = 1; l < 32; ++l) m = fmin(m, lane_value<T>(all, l));
  return m;
}
}  // namespace metal
using namespace metal;

// ---- each thread's Metal indices, for a grid of (threads, gy, gz) threads in groups of (threads, 1, 1) ----
struct MetalIds {
  uint dispatch_quadgroups_per_threadgroup, dispatch_simdgroups_per_threadgroup;
  uint3 dispatch_threads_per_threadgroup, grid_origin, grid_size;
  uint quadgroup_index_in_threadgroup, quadgroups_per_threadgroup, simdgroup_index_in_threadgroup;
  uint simdgroups_per_threadgroup, thread_execution_width, thread_index_in_quadgroup, thread_index_in_simdgroup;
  uint thread_index_in_threadgroup;
  uint3 thread_position_in_grid, thread_position_in_threadgroup, threadgroup_position_in_grid;
  uint3 threadgroups_per_grid, threads_per_grid;
  uint threads_per_simdgroup;
  uint3 threads_per_threadgroup;

  MetalIds(uint i, uint y, uint z, uint n, uint gy, uint gz)
      : dispatch_quadgroups_per_threadgroup(n / 4), dispatch_simdgroups_per_threadgroup(n / 32),
        dispatch_threads_per_threadgroup{n, 1, 1}, grid_origin{0, 0, 0}, grid_size{n, gy, gz},
        quadgroup_index_in_threadgroup(i / 4), quadgroups_per_threadgroup(n / 4),
        simdgroup_index_in_threadgroup(i / 32), simdgroups_per_threadgroup(n / 32), thread_execution_width(32),
        thread_index_in_quadgroup(i % 4), thread_index_in_simdgroup(i % 32), thread_index_in_threadgroup(i),
        thread_position_in_grid{i, y, z}, thread_position_in_threadgroup{i, 0, 0},
        threadgroup_position_in_grid{0, y, z}, threadgroups_per_grid{1, gy, gz}, threads_per_grid{n, gy, gz},
        threads_per_simdgroup(32), threads_per_threadgroup{n, 1, 1} {}
};

// ---- the launch: threadgroups (y, z) in turn; lane_fn(ids) calls the kernel with the ids it declares ----
template <typename F>
bool gmlx_metal_launch(uint grid_y, uint grid_z, uint threads, F lane_fn) {
  return gmlx_run_lanes(grid_y, grid_z, threads, [&](uint i, uint y, uint z) {
    lane_fn(MetalIds(i, y, z, threads, grid_y, grid_z));
  });
}

// ---- address spaces, last: the headers above use these words (std::thread) ----
#define device
#define thread
#define threadgroup
#define constant volatile
