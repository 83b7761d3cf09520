// expcache_testing.h: hooks for tests, benchmarks and bindings (read-backs, checksums, fault
// injection, pausing the prefetch thread, spin kernels, the structs' sizes).
#include "abi_checks.hpp"
#include "expcache_testing.h"

using expcache::abi::check_handle;
using expcache::abi::guarded;

extern "C" {

expcache_status_t expcache_testing_read_resident(expcache_t* cache, uint32_t layer, uint32_t expert, void* dst,
                                                 uint64_t dst_bytes, uint32_t* out_resident) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(dst, "dst is NULL");
        EXPCACHE_REQUIRE(out_resident, "out_resident is NULL");
        return cache->impl->read_resident(layer, expert, dst, dst_bytes, out_resident);
    });
}

expcache_status_t expcache_testing_read_device(expcache_t* cache, const void* src, void* dst, uint64_t n) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(src && dst, "src and dst must not be NULL");
        EXPCACHE_REQUIRE(n > 0, "n must be > 0");
        return cache->impl->read_device(src, dst, n);
    });
}

expcache_status_t expcache_testing_checksum(expcache_t* cache, uint32_t layer, const expcache_expert_ptrs_t* ptrs,
                                            uint32_t n, void* stream, uint64_t* out_sums) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(ptrs, "ptrs is NULL");
        EXPCACHE_REQUIRE(out_sums, "out_sums is NULL");
        return cache->impl->checksum(layer, ptrs, n, stream, out_sums);
    });
}

expcache_status_t expcache_testing_checksum_async(expcache_t* cache, uint32_t layer, const expcache_expert_ptrs_t* ptrs,
                                                  uint32_t n, void* stream, uint32_t first) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(ptrs, "ptrs is NULL");
        return cache->impl->checksum_async(layer, ptrs, n, stream, first);
    });
}

expcache_status_t expcache_testing_bank_checksum_async(expcache_t* cache, uint32_t layer, const int32_t* slots,
                                                       uint32_t n, void* stream, uint32_t first) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(slots, "slots is NULL");
        return cache->impl->bank_checksum_async(layer, slots, n, stream, first);
    });
}

expcache_status_t expcache_testing_bank_checksum_host_slots_async(expcache_t* cache, uint32_t layer,
                                                                  const int32_t* slots, uint32_t n, void* stream,
                                                                  uint32_t first) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(slots, "slots is NULL");
        return cache->impl->bank_checksum_async(layer, slots, n, stream, first, true);
    });
}

expcache_status_t expcache_testing_checksum_results(expcache_t* cache, uint32_t first, uint32_t n, uint64_t* out) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(out, "out is NULL");
        return cache->impl->checksum_results(first, n, out);
    });
}

expcache_status_t expcache_testing_inject_alloc_failures(expcache_t* cache, uint64_t skip, uint64_t count) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        return cache->impl->inject_alloc_failures(skip, count);
    });
}

expcache_status_t expcache_testing_inject_copy_failures(expcache_t* cache, uint64_t skip, uint64_t count) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        return cache->impl->inject_copy_failures(skip, count);
    });
}

expcache_status_t expcache_testing_inject_staging_failures(expcache_t* cache, uint64_t skip, uint64_t count) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        return cache->impl->inject_staging_failures(skip, count);
    });
}

expcache_status_t expcache_testing_prefetch_pause(expcache_t* cache, uint32_t paused) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(paused <= 1, "paused must be 0 or 1, got %u", paused);
        return cache->impl->prefetch_pause(paused != 0);
    });
}

expcache_status_t expcache_testing_spin_async(expcache_t* cache, void* stream, uint64_t ns) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(ns <= 1000000000ull, "ns must be at most 1e9 (1 s), got %llu", (unsigned long long)ns);
        return cache->impl->spin(stream, ns);
    });
}

expcache_status_t expcache_testing_device_bytes_in_use(const expcache_t* cache, uint64_t* out_bytes) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(out_bytes, "out_bytes is NULL");
        return cache->impl->device_bytes_in_use(out_bytes);
    });
}

expcache_status_t expcache_testing_table_reads(expcache_t* cache, uint32_t layer, uint64_t* out_count) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(out_count, "out_count is NULL");
        return cache->impl->table_reads(layer, out_count);
    });
}

expcache_status_t expcache_testing_device_reads(const expcache_t* cache, uint64_t* out_syncs, uint64_t* out_copies) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(out_syncs && out_copies, "out_syncs and out_copies must not be NULL");
        return cache->impl->device_reads(out_syncs, out_copies);
    });
}

uint32_t expcache_testing_struct_size(uint32_t which) {
    switch (which) {
        case EXPCACHE_STRUCT_CONFIG:
            return sizeof(expcache_config_t);
        case EXPCACHE_STRUCT_LAYER_DESC:
            return sizeof(expcache_layer_desc_t);
        case EXPCACHE_STRUCT_EXPERT_PTRS:
            return sizeof(expcache_expert_ptrs_t);
        case EXPCACHE_STRUCT_COMPACT:
            return sizeof(expcache_compact_t);
        case EXPCACHE_STRUCT_CLASS_INFO:
            return sizeof(expcache_class_info_t);
        case EXPCACHE_STRUCT_STATS:
            return sizeof(expcache_stats_t);
        case EXPCACHE_STRUCT_STAGING_STATS:
            return sizeof(expcache_staging_stats_t);
        case EXPCACHE_STRUCT_PREFETCH_STATS:
            return sizeof(expcache_prefetch_stats_t);
        case EXPCACHE_STRUCT_BANK:
            return sizeof(expcache_bank_t);
        case EXPCACHE_STRUCT_POOL_STATS:
            return sizeof(expcache_pool_stats_t);
        default:
            return 0;
    }
}
static_assert(EXPCACHE_STRUCT_COUNT == 10, "expcache_testing_struct_size covers every EXPCACHE_STRUCT_*");

}  // extern "C"
