// A CPU stand-in for CUDA's execution model, enough to run inferd's kernel sources on the host
// (tests only). Every CUDA thread of a CTA is a fiber (ucontext) on one OS thread, resumed in
// rounds until it blocks at a barrier; CTAs run one after another.
//   __syncthreads      a barrier over the CTA's fibers
//   __shfl_xor_sync    lanes exchange through memory between two barriers of their warp
//   __shared__         a static: one copy, which the (sequential) CTAs take turns using
// It checks what real hardware would fault on: vector loads from misaligned addresses. And it runs
// the kernels' float arithmetic as CuPy compiles it, with -ftz=true (CuPy adds it to every NVRTC
// compile): subnormal inputs and results of float operations are flushed to zero of their sign
// (SSE's DAZ and FTZ modes while a launch runs; on other processors they are not flushed).
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <ucontext.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define INFERD_EMU_FLUSH_SUBNORMALS 1
#endif

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__ static

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(8) float2 {
    float x, y;
};
struct alignas(8) uint2 {
    unsigned x, y;
};

namespace emu {
inline dim3 grid_dim, block_dim, thread_idx, block_idx;

struct Barrier {
    unsigned expected = 0, arrived = 0, generation = 0;
};
inline Barrier cta_barrier;
inline Barrier warp_barriers[32];
inline float warp_lanes[32][32];  // [warp][lane]: the values in flight of one shuffle

struct Fiber {
    ucontext_t context;
    std::vector<char> stack;
    bool done = false;
};
inline ucontext_t scheduler;
inline Fiber* fibers = nullptr;
inline unsigned current = 0;
inline std::function<void()> body;

inline void yield() { swapcontext(&fibers[current].context, &scheduler); }

inline void wait(Barrier& b) {
    const unsigned generation = b.generation;
    if (++b.arrived == b.expected) {
        b.arrived = 0;
        ++b.generation;
        return;
    }
    while (b.generation == generation) yield();
}

inline void fiber_main() {
    body();
    fibers[current].done = true;
    swapcontext(&fibers[current].context, &scheduler);
}

#ifdef INFERD_EMU_FLUSH_SUBNORMALS
constexpr unsigned kFlushSubnormals = 0x8040;  // MXCSR: FTZ (bit 15) and DAZ (bit 6)
inline unsigned flush_subnormals() {  // -> the previous MXCSR
    const unsigned mxcsr = _mm_getcsr();
    _mm_setcsr(mxcsr | kFlushSubnormals);
    return mxcsr;
}
inline void restore_subnormals(unsigned mxcsr) { _mm_setcsr(mxcsr); }
#else
inline unsigned flush_subnormals() { return 0; }
inline void restore_subnormals(unsigned) {}
#endif

template <typename Kernel, typename... Args>
void launch(dim3 grid, dim3 block, Kernel kernel, Args... args) {
    const unsigned mxcsr = flush_subnormals();  // (before the fibers' getcontext: they inherit it)
    const unsigned n = block.x * block.y * block.z;
    grid_dim = grid;
    block_dim = block;
    std::vector<Fiber> pool(n);
    fibers = pool.data();
    std::vector<unsigned> order(n);
    for (unsigned t = 0; t < n; ++t) order[t] = t;
    std::mt19937 rng(12345);
    body = [=] { kernel(args...); };
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                block_idx = dim3{x, y, z};
                cta_barrier = Barrier{n};
                for (unsigned w = 0; w < (n + 31) / 32; ++w) warp_barriers[w] = Barrier{std::min(32u, n - 32 * w)};
                for (auto& f : pool) {
                    f.done = false;
                    f.stack.resize(256 * 1024);
                    getcontext(&f.context);
                    f.context.uc_stack.ss_sp = f.stack.data();
                    f.context.uc_stack.ss_size = f.stack.size();
                    f.context.uc_link = nullptr;
                    makecontext(&f.context, fiber_main, 0);
                }
                // each round resumes a random half of the fibers in a random order, so warps
                // drift apart as far as the barriers let them: a kernel that reads shared memory
                // another warp writes without a barrier in between reads it too early
                for (unsigned live = n; live > 0;) {
                    live = 0;
                    std::shuffle(order.begin(), order.end(), rng);
                    for (const unsigned t : order) {
                        if (pool[t].done) continue;
                        if (rng() & 1) {
                            ++live;
                            continue;
                        }
                        current = t;
                        thread_idx = dim3{t, 0, 0};
                        swapcontext(&scheduler, &pool[t].context);
                        live += !pool[t].done;
                    }
                }
            }
    fibers = nullptr;
    restore_subnormals(mxcsr);
}
}  // namespace emu

#define threadIdx emu::thread_idx
#define blockIdx emu::block_idx
#define gridDim emu::grid_dim
#define blockDim emu::block_dim

inline void __syncthreads() { emu::wait(emu::cta_barrier); }

inline float __shfl_xor_sync(unsigned, float value, int offset) {
    const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    emu::warp_lanes[warp][lane] = value;
    emu::wait(emu::warp_barriers[warp]);
    const float other = emu::warp_lanes[warp][lane ^ offset];
    emu::wait(emu::warp_barriers[warp]);
    return other;
}

inline unsigned __shfl_xor_sync(unsigned mask, unsigned value, int offset) {  // (the bits, moved as they are)
    float bits;
    memcpy(&bits, &value, 4);
    const float other = __shfl_xor_sync(mask, bits, offset);
    memcpy(&value, &other, 4);
    return value;
}

inline float __int_as_float(int bits) {
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

inline int __float_as_int(float f) {
    int bits;
    memcpy(&bits, &f, 4);
    return bits;
}

// byte i of the result is byte (selector >> 4i) & 7 of y:x (the sign-replicating mode is not modelled)
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned selector) {
    const uint64_t bytes = (uint64_t)y << 32 | x;
    unsigned result = 0;
    for (int i = 0; i < 4; ++i) result |= (unsigned)((bytes >> (8 * ((selector >> (4 * i)) & 7))) & 0xff) << (8 * i);
    return result;
}

inline unsigned __float_as_uint(float f) {
    unsigned bits;
    memcpy(&bits, &f, 4);
    return bits;
}

using std::max;
using std::min;

// reinterpret_cast<const uint4*>/<const float4*> of a misaligned address faults on a GPU
#define INFERD_CHECK_ALIGNED(p, n)                                                   \
    do {                                                                                 \
        if (reinterpret_cast<uintptr_t>(p) % (n)) {                                      \
            fprintf(stderr, "misaligned %d-byte access at %p\n", (int)(n), (const void*)(p)); \
            abort();                                                                     \
        }                                                                                \
    } while (0)
