// The select kernel's side of the copy-engine path (engine_protocol.hpp) on the CUDA backend: the
// leader lists each miss for the poller, then waits for the copier's word and frees the slots of
// a select whose copies failed. Included by lookup_kernels_cuda.cu only.
#pragma once

#include <cuda/atomic>

#include "engine_protocol.hpp"
#include "feed_protocol.hpp"
#include "lookup_kernels.hpp"
#include "lookup_rules.hpp"

namespace expcache {
namespace engine_cuda {

// The leader's thread 0: miss m (expert `expert` of `layer` into `slot`) listed for the poller.
__device__ inline void list(const DeviceEngine& e, uint32_t layer, uint32_t expert, int32_t slot, uint32_t m,
                            uint64_t done) {
    volatile EngineEntry* entry = &e.box->entry[m];
    entry->layer = layer;
    entry->expert = expert;
    entry->slot = slot;
    cuda::atomic_ref<uint64_t, cuda::thread_scope_system>(e.box->listed)
        .store(done | (m + 1), cuda::memory_order_release);
}

// The leader's thread 0, once it has listed all `misses` of the select numbered `done`: waits for
// the copier's word to reach the last one; when a copy failed (or no word came within
// kFeedTimeoutNs), the select's misses are forgotten and their ids given slot -1.
__device__ inline void settle(const DeviceSelectArgs& a, uint64_t done, uint32_t misses) {
    const DeviceEngine& e = a.cls.engine;
    cuda::atomic_ref<uint64_t, cuda::thread_scope_system> word(*e.done);
    uint64_t start;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    uint64_t w;
    bool failed = false;
    while ((w = word.load(cuda::memory_order_acquire)) < (done | misses)) {
        uint64_t now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (now - start > kFeedTimeoutNs) {
            failed = true;
            break;
        }
        __nanosleep(128);
    }
    failed = failed || ((w & kEngineFailed) && (w >> kPublishShift) == (done >> kPublishShift));
    if (!failed) return;
    for (uint32_t m = 0; m < misses; ++m) {
        const int32_t slot = a.cls.misses[m].slot;
        forget_slot(a.cls, a.slot_of_key, static_cast<uint32_t>(slot));
        for (uint32_t i = 0; i < a.count; ++i)  // the ids whose expert never came: no slot, as an id out of range
            if (a.out_slots[i] == slot) a.out_slots[i] = -1;
    }
    atomicAdd(reinterpret_cast<unsigned long long*>(e.failures), static_cast<unsigned long long>(misses));
}

}  // namespace engine_cuda
}  // namespace expcache
