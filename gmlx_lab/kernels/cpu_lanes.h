// GPU lanes on the CPU, shared by prelude_cpu.h (CUDA sources) and shim_metal_cpu.h (Metal sources).
//
// Execution model: gmlx_run_lanes runs the grid's threadgroups one after another. A threadgroup's lanes are
// fibers (each lane its own stack, all on the calling OS thread) that take turns in lane order: a
// lane runs until it reaches a barrier or a SIMD-group operation, then the next lane runs. Every SIMD-group
// operation (shuffles, reductions, the fragment product, the SIMD-group barrier) waits for the 32 lanes of
// the calling lane's group (warp) only; the threadgroup barrier waits for the whole group. A SIMD-group
// exchange writes a lane's words into one of two per-group buffers (alternating), waits for the group, then
// reads the other lanes' words: the next write to the same buffer comes after the next wait, when every lane
// has finished reading, so one wait per operation suffices. Every lane must reach every such operation
// (uniform control flow), as the kernels' CUDA and Metal sources already require; a lane that never does
// leaves the others waiting forever. Lanes switch at these points only, in a fixed order, so a run is
// deterministic, and a body that reads what other lanes write without waiting for them reads stale values.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <stdint.h>
#include <vector>

// ---- fibers: a stack each, and a switch between them ----
// gmlx_switch(from, to) stores the running fiber's place in `from` and continues `to` where it last left off
// (or at its start). On x86-64 that is 12 instructions (the callee-saved registers go on the fiber's own
// stack, then the stack pointers are exchanged): about 10 ns, where ucontext's swapcontext, used elsewhere,
// also makes a system call (about 0.5 us). A Metal fragment product is 32 SIMD shuffles, each a switch to
// every lane of the SIMD group, so this is most of the time the tests spend on the Metal sources.
#if defined(__x86_64__) && !defined(GMLX_UCONTEXT)
struct GmlxFiber { void* sp = nullptr; };
// gmlx_switch_sp(save_sp, load_sp): push the callee-saved registers, store the stack pointer at *save_sp (rdi),
// load load_sp (rsi) as the stack pointer, pop that fiber's registers and return into it.
__attribute__((naked, noinline)) static void gmlx_switch_sp(void** /*save_sp*/, void* /*load_sp*/) {
  asm("pushq %rbp\n pushq %rbx\n pushq %r12\n pushq %r13\n pushq %r14\n pushq %r15\n"
      "movq %rsp, (%rdi)\n movq %rsi, %rsp\n"
      "popq %r15\n popq %r14\n popq %r13\n popq %r12\n popq %rbx\n popq %rbp\n ret\n");
}
inline void gmlx_switch(GmlxFiber& from, GmlxFiber& to) { gmlx_switch_sp(&from.sp, to.sp); }
// A new fiber's stack as gmlx_switch_sp leaves it: six saved registers, then `entry` as the return address
// (and a null one above it, so that `entry` starts with the stack aligned as after a call). `entry` never returns.
inline void gmlx_fiber_init(GmlxFiber& f, char* stack, size_t size, void (*entry)()) {
  void** sp = reinterpret_cast<void**>((reinterpret_cast<uintptr_t>(stack) + size) & ~uintptr_t(15));
  *--sp = nullptr;
  *--sp = reinterpret_cast<void*>(entry);
  for (int i = 0; i < 6; ++i) *--sp = nullptr;
  f.sp = sp;
}
#else                                              // elsewhere, or with -DGMLX_UCONTEXT (a test builds it)
#ifndef _XOPEN_SOURCE
#define _XOPEN_SOURCE 700                          // macOS declares the ucontext functions only with it
#endif
#include <ucontext.h>
struct GmlxFiber { ucontext_t ctx; };
inline void gmlx_switch(GmlxFiber& from, GmlxFiber& to) { swapcontext(&from.ctx, &to.ctx); }
inline void gmlx_fiber_init(GmlxFiber& f, char* stack, size_t size, void (*entry)()) {
  getcontext(&f.ctx);
  f.ctx.uc_stack.ss_sp = stack;
  f.ctx.uc_stack.ss_size = size;
  f.ctx.uc_link = nullptr;
  makecontext(&f.ctx, entry, 0);
}
#endif

// ---- lanes ----
struct GmlxWarp;
struct GmlxLane {                                  // one GPU lane: its fiber and what it knows of itself
  GmlxFiber fiber;
  uint32_t tid = 0;                                // index in the threadgroup
  uint32_t parity = 0;                             // which exchange buffer its next SIMD-group operation uses
  GmlxWarp* warp = nullptr;
  bool done = false;
};
inline GmlxLane* gmlx_cur = nullptr;               // the running lane
inline GmlxFiber gmlx_scheduler;                   // the launching thread's own stack

// Hand the CPU back to the scheduler, which runs the next lane; this lane resumes on its next turn.
inline void gmlx_yield() { gmlx_switch(gmlx_cur->fiber, gmlx_scheduler); }

inline uint64_t gmlx_events = 0;                   // arrivals at barriers and finished lanes, so far

// `n` lanes wait here until all have arrived (the last to arrive starts the next generation).
struct GmlxBarrier {
  uint32_t n, arrived = 0, generation = 0;
  explicit GmlxBarrier(uint32_t count) : n(count) {}
  void arrive_and_wait() {
    ++gmlx_events;
    const uint32_t gen = generation;
    if (++arrived == n) { arrived = 0; ++generation; return; }
    while (generation == gen) gmlx_yield();
  }
};

struct GmlxWarp {
  static constexpr int WORDS = 8;                  // words per lane per exchange (CUDA's mma: a[4], b[2])
  GmlxBarrier sync{32};
  uint32_t xch[2][32][WORDS];                      // two exchange buffers, used alternately
};
inline GmlxBarrier* gmlx_block = nullptr;          // the running threadgroup's barrier

inline void gmlx_block_barrier() { gmlx_block->arrive_and_wait(); }
inline void gmlx_warp_barrier() { gmlx_cur->warp->sync.arrive_and_wait(); }
inline uint32_t gmlx_tid() { return gmlx_cur->tid; }
inline uint32_t gmlx_lane() { return gmlx_cur->tid & 31u; }

typedef uint32_t GmlxRow[GmlxWarp::WORDS];         // one lane's words of an exchange

// Publish this lane's `n` words, wait for the warp, return the exchange buffer holding every lane's words.
inline const GmlxRow* gmlx_exchange(const uint32_t* words, int n) {
  GmlxRow* buf = gmlx_cur->warp->xch[gmlx_cur->parity];
  gmlx_cur->parity ^= 1u;
  std::memcpy(buf[gmlx_lane()], words, sizeof(uint32_t) * n);
  gmlx_warp_barrier();
  return buf;
}

// The running lane's work: lane_fn(index, group_y, group_z) of the launch in progress; a finished lane
// switches back to the scheduler for good.
inline void (*gmlx_lane_entry)(void* fn, uint32_t i, uint32_t y, uint32_t z) = nullptr;
inline void* gmlx_lane_fn = nullptr;
inline uint32_t gmlx_group_y = 0, gmlx_group_z = 0;
inline void gmlx_fiber_main() {
  gmlx_lane_entry(gmlx_lane_fn, gmlx_cur->tid, gmlx_group_y, gmlx_group_z);
  gmlx_cur->done = true;
  ++gmlx_events;
  gmlx_yield();
}

// The launch: threadgroups (y, z) in turn, each as `threads` lanes calling lane_fn(index, y, z). The
// scheduler resumes the unfinished lanes in lane order until all have finished. A turn of every unfinished lane
// in which none arrives anywhere or finishes is a deadlock: some lanes wait at a barrier or SIMD-group operation
// that others never reach (a branch that not all lanes take, or lanes that have returned); the launch stops
// and returns false. One launch at a time per process (the running lane and group are plain globals, as is
// the kernel's threadgroup memory).
template <typename F>
bool gmlx_run_lanes(uint32_t grid_y, uint32_t grid_z, uint32_t threads, F lane_fn) {
  constexpr size_t STACK = 256 * 1024;
  std::unique_ptr<char[]> stacks(new char[threads * STACK]);
  gmlx_lane_fn = &lane_fn;
  gmlx_lane_entry = [](void* fn, uint32_t i, uint32_t y, uint32_t z) { (*static_cast<F*>(fn))(i, y, z); };
  for (uint32_t z = 0; z < grid_z; ++z) for (uint32_t y = 0; y < grid_y; ++y) {
    gmlx_group_y = y;
    gmlx_group_z = z;
    GmlxBarrier block(threads);
    gmlx_block = &block;
    std::vector<std::unique_ptr<GmlxWarp>> warps;
    for (uint32_t w = 0; w < threads / 32; ++w) warps.push_back(std::make_unique<GmlxWarp>());
    std::vector<GmlxLane> lanes(threads);
    for (uint32_t i = 0; i < threads; ++i) {
      lanes[i].tid = i;
      lanes[i].warp = warps[i / 32].get();
      gmlx_fiber_init(lanes[i].fiber, stacks.get() + i * STACK, STACK, gmlx_fiber_main);
    }
    for (bool running = true; running;) {
      running = false;
      const uint64_t events = gmlx_events;
      for (GmlxLane& lane : lanes) {
        if (lane.done) continue;
        gmlx_cur = &lane;
        gmlx_switch(gmlx_scheduler, lane.fiber);
        running |= !lane.done;
      }
      if (running && gmlx_events == events) return gmlx_cur = nullptr, false;
    }
    gmlx_cur = nullptr;
  }
  return true;
}
