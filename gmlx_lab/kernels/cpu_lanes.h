// GPU lanes as CPU threads, shared by prelude_cpu.h (CUDA sources) and shim_metal_cpu.h (Metal sources).
//
// Execution model: gmlx_run_lanes runs the grid's threadgroups one after another; for each it starts one
// OS thread per lane, gives each its index in the group and its 32-lane SIMD group (warp), and calls
// lane_fn(index, group_y, group_z). Every SIMD-group operation (shuffles, reductions, the fragment product,
// the SIMD-group barrier) synchronizes only the 32 lanes of the calling thread's group, on that group's own
// std::barrier; the threadgroup barrier synchronizes the whole group. A SIMD-group exchange writes a lane's
// words into one of two per-group buffers (alternating), waits on the group's barrier, then reads the other
// lanes' words: the next write to the same buffer comes after the next barrier, when every lane has finished
// reading, so one barrier per operation suffices. Every lane must reach every such operation (uniform
// control flow), as the kernels' CUDA and Metal sources already require.
#pragma once

#include <barrier>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <stdint.h>
#include <thread>
#include <vector>

struct GmlxWarp {
  static constexpr int WORDS = 8;                  // words per lane per exchange (CUDA's mma: a[4], b[2])
  std::barrier<> sync{32};
  uint32_t xch[2][32][WORDS];                      // two exchange buffers, used alternately
};
inline thread_local GmlxWarp* gmlx_warp = nullptr;
inline thread_local std::barrier<>* gmlx_block = nullptr;
inline thread_local uint32_t gmlx_tid = 0;         // this lane's index in its threadgroup
inline thread_local uint32_t gmlx_parity = 0;      // which exchange buffer this lane's next operation uses

inline void gmlx_block_barrier() { gmlx_block->arrive_and_wait(); }
inline void gmlx_warp_barrier() { gmlx_warp->sync.arrive_and_wait(); }
inline uint32_t gmlx_lane() { return gmlx_tid & 31u; }

typedef uint32_t GmlxRow[GmlxWarp::WORDS];         // one lane's words of an exchange

// Publish this lane's `n` words, wait for the warp, return the exchange buffer holding every lane's words.
inline const GmlxRow* gmlx_exchange(const uint32_t* words, int n) {
  GmlxRow* buf = gmlx_warp->xch[gmlx_parity];
  gmlx_parity ^= 1u;
  std::memcpy(buf[gmlx_lane()], words, sizeof(uint32_t) * n);
  gmlx_warp_barrier();
  return buf;
}

// The launch: threadgroups (y, z) in turn, each as `threads` OS threads calling lane_fn(index, y, z).
template <typename F>
void gmlx_run_lanes(uint32_t grid_y, uint32_t grid_z, uint32_t threads, F lane_fn) {
  for (uint32_t z = 0; z < grid_z; ++z) for (uint32_t y = 0; y < grid_y; ++y) {
    std::barrier<> block(threads);
    std::vector<std::unique_ptr<GmlxWarp>> warps;
    for (uint32_t w = 0; w < threads / 32; ++w) warps.push_back(std::make_unique<GmlxWarp>());
    std::vector<std::thread> lanes;
    for (uint32_t i = 0; i < threads; ++i) {
      lanes.emplace_back([&, i] {
        gmlx_tid = i;
        gmlx_warp = warps[i / 32].get();
        gmlx_block = &block;
        gmlx_parity = 0;
        lane_fn(i, y, z);
      });
    }
    for (std::thread& lane : lanes) lane.join();
  }
}
