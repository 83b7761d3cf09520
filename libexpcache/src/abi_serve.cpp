// The C ABI's serving calls: select (plain, split, on the device), prefetch and hints, compact
// loads, prefill batches, the device banks, release_all and synchronize.
#include "abi_checks.hpp"

using expcache::Cache;
using expcache::kMaxBatchIds;
using expcache::kMaxCompact;
using expcache::abi::check_handle;
using expcache::abi::check_struct;
using expcache::abi::guarded;

extern "C" {

expcache_status_t expcache_select_async(expcache_t* cache, uint32_t layer, const uint32_t* ids, uint32_t k,
                                        void* stream, expcache_expert_ptrs_t* out_ptrs) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(ids, "ids is NULL");
        EXPCACHE_REQUIRE(out_ptrs, "out_ptrs is NULL");
        return cache->impl->select(layer, ids, k, stream, out_ptrs);
    });
}

expcache_status_t expcache_select_ids_async(expcache_t* cache, uint32_t layer, const void* ids, uint32_t id_bits,
                                            uint32_t k, void* stream, expcache_expert_ptrs_t* out_ptrs) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(ids, "ids is NULL");
        EXPCACHE_REQUIRE(out_ptrs, "out_ptrs is NULL");
        return cache->impl->select_ids(layer, ids, id_bits, k, stream, out_ptrs);
    });
}

expcache_status_t expcache_select_split_async(expcache_t* cache, uint32_t layer, const uint32_t* ids, uint32_t k,
                                              void* stream, expcache_expert_ptrs_t* out_ptrs, uint8_t* out_resident,
                                              void** out_ready) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(ids, "ids is NULL");
        EXPCACHE_REQUIRE(out_ptrs, "out_ptrs is NULL");
        EXPCACHE_REQUIRE(out_resident, "out_resident is NULL");
        EXPCACHE_REQUIRE(out_ready, "out_ready is NULL");
        return cache->impl->select_split(layer, ids, k, stream, out_ptrs, out_resident, out_ready);
    });
}

expcache_status_t expcache_select_slots_async(expcache_t* cache, uint32_t layer, const void* ids, uint32_t id_bits,
                                              uint32_t k, int32_t* out_slots, void* stream) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(ids, "ids is NULL");
        EXPCACHE_REQUIRE(out_slots, "out_slots is NULL");
        return cache->impl->select_slots(layer, ids, id_bits, k, out_slots, stream);
    });
}

expcache_status_t expcache_ready_wait_async(expcache_t* cache, void* ready, void* stream) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        return cache->impl->wait_ready(ready, stream);
    });
}

expcache_status_t expcache_prefetch_async(expcache_t* cache, uint32_t layer, const uint32_t* ids, uint32_t n,
                                          void* stream, uint32_t* out_queued) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(ids, "ids is NULL");
        return cache->impl->prefetch(layer, ids, n, stream, out_queued);
    });
}

expcache_status_t expcache_prefetch_wait(expcache_t* cache) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        return cache->impl->prefetch_wait();
    });
}

expcache_status_t expcache_hint(expcache_t* cache, uint32_t layer, const uint32_t* ids, uint32_t n) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(ids, "ids is NULL");
        return cache->impl->hint(layer, ids, n);
    });
}

expcache_status_t expcache_compact_load_async(expcache_t* cache, uint32_t layer, const uint32_t* ids, uint32_t n,
                                              void* stream, expcache_compact_t* out) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(ids, "ids is NULL");
        EXPCACHE_TRY(check_struct(out, "out"));
        return cache->impl->load_compact(layer, ids, n, stream, out);
    });
}

expcache_status_t expcache_batch_prepare_async(expcache_t* cache, uint32_t layer, const uint32_t* ids, uint64_t n,
                                               void* stream, uint32_t* out_ids, expcache_expert_ptrs_t* out_ptrs,
                                               uint32_t* out_count, uint64_t* out_batch) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(ids, "ids is NULL");
        EXPCACHE_REQUIRE(out_ids && out_ptrs && out_count && out_batch,
                         "out_ids, out_ptrs, out_count and out_batch must not be NULL");
        return cache->impl->batch_prepare(layer, ids, n, stream, out_ids, out_ptrs, nullptr, out_count, out_batch);
    });
}

expcache_status_t expcache_batch_prepare_slots_async(expcache_t* cache, uint32_t layer, const void* ids,
                                                     uint32_t id_bits, uint64_t n, void* stream, uint32_t* out_ids,
                                                     int32_t* out_slots, uint32_t* out_count, uint64_t* out_batch) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(ids, "ids is NULL");
        EXPCACHE_REQUIRE(out_ids && out_slots && out_count && out_batch,
                         "out_ids, out_slots, out_count and out_batch must not be NULL");
        return cache->impl->batch_prepare_slots(layer, ids, id_bits, n, stream, out_ids, out_slots, out_count,
                                                out_batch);
    });
}

expcache_status_t expcache_insert_async(expcache_t* cache, uint32_t layer, const void* ids, uint32_t id_bits,
                                        const float* priorities, uint32_t n, void* stream) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(ids, "ids is NULL");
        std::vector<uint32_t> narrowed;
        EXPCACHE_TRY(Cache::narrow_ids(layer, ids, id_bits, n, expcache::kMaxInsert, "n", &narrowed));
        return cache->impl->insert(layer, narrowed.data(), priorities, n, stream);
    });
}

// The twins that take a router's ids as they are (id_bits 32 or 64): narrowed, then the call.
expcache_status_t expcache_select_split_ids_async(expcache_t* cache, uint32_t layer, const void* ids, uint32_t id_bits,
                                                  uint32_t k, void* stream, expcache_expert_ptrs_t* out_ptrs,
                                                  uint8_t* out_resident, void** out_ready) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(ids, "ids is NULL");
        EXPCACHE_REQUIRE(out_ptrs, "out_ptrs is NULL");
        EXPCACHE_REQUIRE(out_resident, "out_resident is NULL");
        EXPCACHE_REQUIRE(out_ready, "out_ready is NULL");
        const uint32_t* narrowed = nullptr;
        EXPCACHE_TRY(Cache::narrow_decode(layer, ids, id_bits, k, &narrowed, "k"));
        return cache->impl->select_split(layer, narrowed, k, stream, out_ptrs, out_resident, out_ready);
    });
}

expcache_status_t expcache_prefetch_ids_async(expcache_t* cache, uint32_t layer, const void* ids, uint32_t id_bits,
                                              uint32_t n, void* stream, uint32_t* out_queued) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(ids, "ids is NULL");
        const uint32_t* narrowed = nullptr;
        EXPCACHE_TRY(Cache::narrow_decode(layer, ids, id_bits, n, &narrowed, "n"));
        return cache->impl->prefetch(layer, narrowed, n, stream, out_queued);
    });
}

expcache_status_t expcache_hint_ids(expcache_t* cache, uint32_t layer, const void* ids, uint32_t id_bits, uint32_t n) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(ids, "ids is NULL");
        const uint32_t* narrowed = nullptr;
        EXPCACHE_TRY(Cache::narrow_decode(layer, ids, id_bits, n, &narrowed, "n"));
        return cache->impl->hint(layer, narrowed, n);
    });
}

expcache_status_t expcache_compact_load_ids_async(expcache_t* cache, uint32_t layer, const void* ids, uint32_t id_bits,
                                                  uint32_t n, void* stream, expcache_compact_t* out) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(ids, "ids is NULL");
        EXPCACHE_TRY(check_struct(out, "out"));
        std::vector<uint32_t> narrowed;
        EXPCACHE_TRY(Cache::narrow_ids(layer, ids, id_bits, n, kMaxCompact, "n", &narrowed));
        return cache->impl->load_compact(layer, narrowed.data(), n, stream, out);
    });
}

expcache_status_t expcache_batch_prepare_ids_async(expcache_t* cache, uint32_t layer, const void* ids, uint32_t id_bits,
                                                   uint64_t n, void* stream, uint32_t* out_ids,
                                                   expcache_expert_ptrs_t* out_ptrs, uint32_t* out_count,
                                                   uint64_t* out_batch) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(ids, "ids is NULL");
        EXPCACHE_REQUIRE(out_ids && out_ptrs && out_count && out_batch,
                         "out_ids, out_ptrs, out_count and out_batch must not be NULL");
        std::vector<uint32_t> narrowed;
        EXPCACHE_TRY(Cache::narrow_ids(layer, ids, id_bits, n, kMaxBatchIds, "n", &narrowed));
        return cache->impl->batch_prepare(layer, narrowed.data(), n, stream, out_ids, out_ptrs, nullptr, out_count,
                                          out_batch);
    });
}

expcache_status_t expcache_batch_finish(expcache_t* cache, uint64_t batch, void* stream) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        return cache->impl->batch_finish(batch, stream);
    });
}

expcache_status_t expcache_release_all(expcache_t* cache) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        return cache->impl->release_all();
    });
}

expcache_status_t expcache_select_device_async(expcache_t* cache, uint32_t layer, const void* ids, uint32_t id_bits,
                                               uint32_t n, uint32_t k, int32_t* out_slots, void* stream) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(ids, "ids is NULL");
        EXPCACHE_REQUIRE(out_slots, "out_slots is NULL");
        return cache->impl->select_device(layer, ids, id_bits, n, k, out_slots, nullptr, stream);
    });
}

expcache_status_t expcache_select_device_counted_async(expcache_t* cache, uint32_t layer, const void* ids,
                                                       uint32_t id_bits, uint32_t n, uint32_t k, int32_t* out_slots,
                                                       uint32_t* out_counts, void* stream) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(ids, "ids is NULL");
        EXPCACHE_REQUIRE(out_slots, "out_slots is NULL");
        EXPCACHE_REQUIRE(out_counts, "out_counts is NULL");
        return cache->impl->select_device(layer, ids, id_bits, n, k, out_slots, out_counts, stream);
    });
}

expcache_status_t expcache_class_bank_get(expcache_t* cache, uint32_t class_index, expcache_bank_t* out) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_TRY(check_struct(out, "out"));
        return cache->impl->bank(class_index, out);
    });
}

expcache_status_t expcache_synchronize(expcache_t* cache, void* stream) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        return cache->impl->synchronize(stream);
    });
}

}  // extern "C"
