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
