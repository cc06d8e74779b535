// Prelude for mx.fast.metal_kernel: the names every kernel body in this folder uses.
// MLX generates `[[kernel]] void name(const device T* in [[buffer(i)]]..., ...)`; this text goes in its header.
#define GMLX_METAL 1
#define SHARED threadgroup                       // per-threadgroup memory
#define GLOBAL_CONST const device                // a read-only pointer into device memory
#define GLOBAL device                            // a writable pointer into device memory
#define BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define UNROLL _Pragma("clang loop unroll(full)")
#define FN inline
#define HALF half
#define TO_FLOAT(x) float(x)
#define TO_HALF(x) half(x)
#define AS_FLOAT(u) as_type<float>(u)            // reinterpret the 32 bits of a u32 as a float
#define NEG_INF (-INFINITY)
typedef uint u32;
typedef ulong u64;

// Any float type (float, half, bfloat) to and from float32: queries and outputs keep the model's dtype.
template <typename T> FN float load_f(T x) { return float(x); }
template <typename T> FN void store_f(device T* p, float x) { *p = T(x); }

// SIMD-group (32 lanes on Apple GPUs) reductions are built in.
FN float simd_sum_f(float x) { return simd_sum(x); }
FN float simd_max_f(float x) { return simd_max(x); }
FN float simd_min_f(float x) { return simd_min(x); }
FN float simd_shuffle_f(float x, u32 lane) { return simd_shuffle(x, ushort(lane)); }
FN float simd_shuffle_xor_f(float x, u32 mask) { return simd_shuffle_xor(x, ushort(mask)); }

// Metal names the address space of every pointer and reference: a thread's own, and threadgroup memory.
#define THREAD thread
#define SHARED_PTR threadgroup
#define WARP_BARRIER() simdgroup_barrier(mem_flags::mem_threadgroup)

// A counter written through a read-only input, and a device-memory fence. Metal orders device memory only
// inside a threadgroup, so no kernel here lets threadgroups of one launch meet (kvarn_decode runs MERGE = 0);
// these keep the shared bodies compiling.
#define DEVICE_FENCE() threadgroup_barrier(mem_flags::mem_device)
FN u32 atomic_ticket(const device u32* p) {
  return atomic_fetch_add_explicit((device atomic_uint*)p, 1u, memory_order_relaxed);
}
FN void atomic_reset(const device u32* p) { atomic_store_explicit((device atomic_uint*)p, 0u, memory_order_relaxed); }

// float16 pairs held in a u32 (the smaller index in the low half), and one float16 from its bits.
FN u32 pack_half2(float lo, float hi) { return as_type<uint>(half2(lo, hi)); }
FN float half_bits_to_float(u32 bits) { return float(as_type<half>(ushort(bits))); }

// C += A B with the fragments of CUDA's mma.m16n8k16 (layout in kvarn_decode.h), computed by SIMD
// shuffles: lane (g, t) gathers rows g, g+8 of A and columns 2t, 2t+1 of B from the lanes holding them.
FN void mma16816(thread float* c, const thread u32* a, const thread u32* b, u32 lane) {
  const ushort g = ushort(lane >> 2), t = ushort(lane & 3u);
  UNROLL for (ushort src = 0; src < 4; ++src) UNROLL for (ushort h = 0; h < 2; ++h) {   // k = 2 src + 8 h, +1
    const half2 ar = as_type<half2>(simd_shuffle(a[2 * h], ushort(4 * g + src)));        // A[g][k]
    const half2 ar8 = as_type<half2>(simd_shuffle(a[2 * h + 1], ushort(4 * g + src)));   // A[g + 8][k]
    const half2 b0 = as_type<half2>(simd_shuffle(b[h], ushort(8 * t + src)));            // B[k][2t]
    const half2 b1 = as_type<half2>(simd_shuffle(b[h], ushort(8 * t + 4 + src)));        // B[k][2t + 1]
    c[0] += float(ar.x) * float(b0.x) + float(ar.y) * float(b0.y);
    c[1] += float(ar.x) * float(b1.x) + float(ar.y) * float(b1.y);
    c[2] += float(ar8.x) * float(b0.x) + float(ar8.y) * float(b0.y);
    c[3] += float(ar8.x) * float(b1.x) + float(ar8.y) * float(b1.y);
  }
}

// kvarn_decode's ring copies device memory into threadgroup memory asynchronously on CUDA; here the copies
// are plain ones, done when issued (the plan never runs the ring on Metal: the ring does not fit in 32 KB).
FN void async_copy16(threadgroup u32* dst, const device u32* src) {
  for (int i = 0; i < 4; ++i) dst[i] = src[i];
}
FN void async_copy4(threadgroup u32* dst, const device u32* src) { dst[0] = src[0]; }
FN void async_commit() {}
template <int N> FN void async_wait() {}

// CUDA's L2 prefetch hint (prelude_cuda.h): the Metal shading language has no such instruction, so here it does
// nothing (a hint changes no value a kernel computes).
template <typename T> FN void prefetch_l2(const device T* p, u32 n, u32 tid, u32 threads) {}
