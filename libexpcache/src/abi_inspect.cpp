// The C ABI's inspection calls: size classes, a layer's class, the paths' names, and the counters
// (per class and path, the staging ring's, prefetch's) and their reset.
#include "abi_checks.hpp"
#include "paths.hpp"

using expcache::abi::check_handle;
using expcache::abi::check_part_sizes;
using expcache::abi::check_struct;
using expcache::abi::guarded;

extern "C" {

const char* expcache_path_name(uint32_t path) {
    return expcache::path_name(path);
}

expcache_status_t expcache_class_count_get(const expcache_t* cache, uint32_t* out_count) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(out_count, "out_count is NULL");
        return cache->impl->class_count(out_count);
    });
}

expcache_status_t expcache_class_info_get(const expcache_t* cache, uint32_t class_index, expcache_class_info_t* out) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_TRY(check_struct(out, "out"));
        return cache->impl->class_info(class_index, out);
    });
}

expcache_status_t expcache_layer_bind_class(expcache_t* cache, uint32_t layer, uint32_t* out_class) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(out_class, "out_class is NULL");
        return cache->impl->layer_class(layer, out_class);
    });
}

expcache_status_t expcache_class_find(const expcache_t* cache, uint64_t gate_bytes, uint64_t up_bytes,
                                      uint64_t down_bytes, uint32_t* out_class) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(out_class, "out_class is NULL");
        const uint64_t bytes[EXPCACHE_MAX_PARTS] = {gate_bytes, up_bytes, down_bytes};
        EXPCACHE_TRY(check_part_sizes(bytes, 3, "gate, up and down sizes"));
        return cache->impl->find_class(bytes, out_class);
    });
}

expcache_status_t expcache_class_find_parts(const expcache_t* cache, uint32_t num_parts, const uint64_t* part_bytes,
                                            uint32_t* out_class) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(part_bytes, "part_bytes is NULL");
        EXPCACHE_REQUIRE(out_class, "out_class is NULL");
        EXPCACHE_REQUIRE(num_parts >= 1 && num_parts <= EXPCACHE_MAX_PARTS, "num_parts must be 1..%d, got %u",
                         EXPCACHE_MAX_PARTS, num_parts);
        uint64_t bytes[EXPCACHE_MAX_PARTS] = {};
        for (uint32_t p = 0; p < num_parts; ++p) bytes[p] = part_bytes[p];
        EXPCACHE_TRY(check_part_sizes(bytes, num_parts, "part_bytes"));
        return cache->impl->find_class(bytes, out_class);
    });
}

expcache_status_t expcache_stats_get(const expcache_t* cache, uint32_t class_index, uint32_t path,
                                     expcache_stats_t* out) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_TRY(check_struct(out, "out"));
        return cache->impl->get_stats(class_index, path, out);
    });
}

expcache_status_t expcache_stats_read(const expcache_t* cache, uint32_t num_classes, expcache_class_info_t* infos,
                                      expcache_stats_t* stats) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_TRY(check_struct(infos, "infos"));
        EXPCACHE_TRY(check_struct(stats, "stats"));
        return cache->impl->read_stats(num_classes, infos, stats);
    });
}

expcache_status_t expcache_staging_stats_get(const expcache_t* cache, expcache_staging_stats_t* out) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_TRY(check_struct(out, "out"));
        return cache->impl->get_staging_stats(out);
    });
}

expcache_status_t expcache_prefetch_stats_get(const expcache_t* cache, expcache_prefetch_stats_t* out) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_TRY(check_struct(out, "out"));
        return cache->impl->get_prefetch_stats(out);
    });
}

expcache_status_t expcache_pool_stats_get(const expcache_t* cache, expcache_pool_stats_t* out) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_TRY(check_struct(out, "out"));
        return cache->impl->get_pool_stats(out);
    });
}

expcache_status_t expcache_stats_reset(expcache_t* cache) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        return cache->impl->reset_stats();
    });
}

}  // extern "C"
