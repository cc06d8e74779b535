// Prelude for mx.fast.cuda_kernel: the names every kernel body in this folder uses.
// MLX generates `__global__ void name(const T* in..., T* out...)`; this text goes in its header.
#define GMLX_CUDA 1
#define SHARED __shared__                        // per-threadgroup (per-block) memory
#define GLOBAL_CONST const                       // a read-only pointer into device memory
#define GLOBAL                                   // a writable pointer into device memory
#define BARRIER() __syncthreads()                // every thread of the group waits here
#define UNROLL _Pragma("unroll")
#define FN __device__ __forceinline__
#define HALF __half                              // MLX's float16 inputs are __half here
#define TO_FLOAT(x) __half2float(x)
#define TO_HALF(x) __float2half_rn(x)
#define AS_FLOAT(u) __uint_as_float(u)           // reinterpret the 32 bits of a u32 as a float
#define NEG_INF (-__int_as_float(0x7f800000))
typedef unsigned int u32;
typedef unsigned long long u64;

// Any float type (float, __half, __nv_bfloat16) to and from float32: queries and outputs keep the model's dtype.
template <typename T> FN float load_f(T x) { return static_cast<float>(x); }
FN float load_f(__half x) { return __half2float(x); }
template <typename T> FN void store_f(T* p, float x) { *p = static_cast<T>(x); }
FN void store_f(__half* p, float x) { *p = __float2half_rn(x); }

// Warp (32-lane SIMD group) reductions by butterfly shuffles.
FN float simd_sum_f(float x) { for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o); return x; }
FN float simd_max_f(float x) { for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o)); return x; }
FN float simd_min_f(float x) { for (int o = 16; o > 0; o >>= 1) x = fminf(x, __shfl_xor_sync(0xffffffffu, x, o)); return x; }
FN float simd_shuffle_f(float x, u32 lane) { return __shfl_sync(0xffffffffu, x, int(lane)); }
FN float simd_shuffle_xor_f(float x, u32 mask) { return __shfl_xor_sync(0xffffffffu, x, int(mask)); }

// Pointers and references into a thread's own registers, and into threadgroup memory, need no qualifier here.
#define THREAD
#define SHARED_PTR
#define WARP_BARRIER() __syncwarp()              // the 32 lanes of a warp wait here (shared-memory exchange)

// Threadgroups of one launch meeting in device memory (kvarn_decode's MERGE): a fence after which this
// thread's writes are visible to every threadgroup, and a counter written through a read-only input.
#define DEVICE_FENCE() __threadfence()
FN u32 atomic_ticket(const u32* p) { return atomicAdd(const_cast<u32*>(p), 1u); }
FN void atomic_reset(const u32* p) { atomicExch(const_cast<u32*>(p), 0u); }

// float16 pairs held in a u32 (the smaller index in the low half), and one float16 from its bits.
FN u32 pack_half2(float lo, float hi) { const __half2 h = __floats2half2_rn(lo, hi); return *reinterpret_cast<const u32*>(&h); }
FN float half_bits_to_float(u32 bits) { return __half2float(__ushort_as_half((unsigned short)bits)); }

// Byte n of the result is byte (s >> 4n) & 7 of the eight bytes of x (0..3) then y (4..7): one PRMT instruction.
FN u32 byte_perm(u32 x, u32 y, u32 s) { return __byte_perm(x, y, s); }
// (a & b) | c in one LOP3 instruction (the compiler splits it into two when b and c are both constants).
FN u32 and_or(u32 a, u32 b, u32 c) { u32 d; asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c)); return d; }

// C += A B on the tensor cores: A 16x16 and B 16x8 float16, C 16x8 float32, one warp, fragments as in
// the PTX ISA's mma.m16n8k16 (their layout is written out in kvarn_decode.h). `lane` is for Metal's version.
FN void mma16816(float* c, const u32* a, const u32* b, u32 lane) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Asynchronous copies from device memory into threadgroup memory (kvarn_decode's ring): 16 or 4 bytes,
// issued without holding registers until they land; a thread groups what it has issued (commit) and waits until
// at most N of its groups are still in flight. Other lanes' copies are visible after a WARP_BARRIER.
FN void async_copy16(u32* dst, const u32* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"((u32)__cvta_generic_to_shared(dst)), "l"(src));
}
FN void async_copy4(u32* dst, const u32* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" :: "r"((u32)__cvta_generic_to_shared(dst)), "l"(src));
}
FN void async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> FN void async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory"); }

// Ask the L2 cache for elements [p, p + n) ahead of their loads, the `threads` threads of a group sharing the
// 128-byte lines that hold some of them: a hint that holds no registers, so the loads that follow wait on L2 rather
// than on device memory.
template <typename T> FN void prefetch_l2(const T* p, u32 n, u32 tid, u32 threads) {
  const char* end = reinterpret_cast<const char*>(p + n);
  for (const char* a = reinterpret_cast<const char*>(reinterpret_cast<size_t>(p) & ~size_t(127)) + size_t(tid) * 128u;
       a < end; a += size_t(threads) * 128u)
    asm volatile("prefetch.global.L2 [%0];" :: "l"(a));
}
