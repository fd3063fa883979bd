// reshape_and_cache: writes the K and V of a step's new tokens into their slots of the paged cache.
//
// Layout (element offsets; T is float, __half or __nv_bfloat16):
//   key, value          [num_tokens, num_kv_heads, head_dim]: token t, head h, dim d at
//                       t * key_stride + h * head_dim + d  (a row may be a slice of the fused
//                       qkv projection, hence its own stride; heads and dims are contiguous)
//   key_cache, value_cache
//                       [num_blocks, block_size, num_kv_heads, head_dim], contiguous: slot s
//                       (= block * block_size + offset in block) starts at s * num_kv_heads * head_dim
//   slot_mapping        [num_tokens] int64: the slot of each token; negative = skip (the padding
//                       rows of a captured batch)
//
// Grid: one CTA per token; threads stride over the num_kv_heads * head_dim elements of its row.
// The spec is inferd.kernels.reference.write_kv.
#include "common.cuh"

template <typename T>
__global__ void reshape_and_cache(
    const T* __restrict__ key,
    const T* __restrict__ value,
    T* __restrict__ key_cache,
    T* __restrict__ value_cache,
    const long long* __restrict__ slot_mapping,
    const long long key_stride,
    const long long value_stride,
    const int row_elems)  // num_kv_heads * head_dim
{
    const long long token = blockIdx.x;
    const long long slot = slot_mapping[token];
    if (slot < 0) return;
    const T* k = key + token * key_stride;
    const T* v = value + token * value_stride;
    T* kc = key_cache + slot * row_elems;
    T* vc = value_cache + slot * row_elems;
    for (int i = threadIdx.x; i < row_elems; i += blockDim.x) {
        kc[i] = k[i];
        vc[i] = v[i];
    }
}
