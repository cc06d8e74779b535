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
#define NEG_INF (-INFINITY)
typedef uint u32;

// SIMD-group (32 lanes on Apple GPUs) reductions are built in.
FN float simd_sum_f(float x) { return simd_sum(x); }
FN float simd_max_f(float x) { return simd_max(x); }
FN float simd_min_f(float x) { return simd_min(x); }
