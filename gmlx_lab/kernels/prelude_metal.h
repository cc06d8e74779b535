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
