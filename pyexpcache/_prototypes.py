"""The C prototypes of libexpcache for ctypes (``FUNCTIONS``): each exported function of expcache.h
and expcache_testing.h with its argtypes and restype, the C prototype quoted above it. ``_lib``
declares them on the library it loads, the status-returning ones (restype c_int32) with its
``errcheck``."""

from __future__ import annotations

from ctypes import POINTER, c_char_p, c_int32, c_uint32, c_uint64, c_void_p

from ._structs import (
    DROPPED_FN,
    LOG_FN,
    Bank,
    CachePtr,
    ClassInfo,
    Compact,
    Config,
    LayerDesc,
    MemoryRefPtr,
    PoolStats,
    PrefetchStats,
    StagingStats,
    Stats,
)

# Each exported function: (name, argtypes, restype); status-returning ones (c_int32) raise on failure.
# expcache.h, in the header's order:
FUNCTIONS = [
    # const char* expcache_status_string(expcache_status_t status);
    ("expcache_status_string", [c_int32], c_char_p),
    # const char* expcache_last_error(void);
    ("expcache_last_error", [], c_char_p),
    # uint32_t expcache_version(void);
    ("expcache_version", [], c_uint32),
    # const char* expcache_policy_name(uint32_t policy);
    ("expcache_policy_name", [c_uint32], c_char_p),
    # expcache_status_t expcache_config_init(expcache_config_t* config);
    ("expcache_config_init", [POINTER(Config)], c_int32),
    # expcache_status_t expcache_create(const expcache_config_t* config, expcache_t** out_cache);
    ("expcache_create", [POINTER(Config), POINTER(CachePtr)], c_int32),
    # void expcache_destroy(expcache_t* cache);
    ("expcache_destroy", [CachePtr], None),
    # expcache_status_t expcache_backend_get(const expcache_t* cache, uint32_t* out_backend);
    ("expcache_backend_get", [CachePtr, POINTER(c_uint32)], c_int32),
    # expcache_status_t expcache_layer_desc_init(expcache_layer_desc_t* desc);
    ("expcache_layer_desc_init", [POINTER(LayerDesc)], c_int32),
    # expcache_status_t expcache_file_open(expcache_t* cache, const char* path, uint32_t* out_file);
    ("expcache_file_open", [CachePtr, c_char_p, POINTER(c_uint32)], c_int32),
    # expcache_status_t expcache_file_open_fd(expcache_t* cache, int fd, uint32_t* out_file);
    ("expcache_file_open_fd", [CachePtr, c_int32, POINTER(c_uint32)], c_int32),
    # expcache_status_t expcache_layer_register(expcache_t* cache, uint32_t layer, const expcache_layer_desc_t* desc);
    ("expcache_layer_register", [CachePtr, c_uint32, POINTER(LayerDesc)], c_int32),
    # expcache_status_t expcache_layers_register(expcache_t* cache, uint32_t n, const uint32_t* layers,
    #                                            const expcache_layer_desc_t* descs);
    ("expcache_layers_register", [CachePtr, c_uint32, c_void_p, c_void_p], c_int32),
    # expcache_status_t expcache_layer_unregister(expcache_t* cache, uint32_t layer);
    ("expcache_layer_unregister", [CachePtr, c_uint32], c_int32),
    # expcache_status_t expcache_budget_set(expcache_t* cache, uint64_t budget_experts, uint64_t budget_bytes);
    ("expcache_budget_set", [CachePtr, c_uint64, c_uint64], c_int32),
    # expcache_status_t expcache_reserve_set(expcache_t* cache, uint64_t reserve_bytes);
    ("expcache_reserve_set", [CachePtr, c_uint64], c_int32),
    # expcache_status_t expcache_budget_get(const expcache_t* cache, uint64_t* out_budget_experts,
    #     uint64_t* out_budget_bytes, uint32_t* out_free_memory);
    ("expcache_budget_get", [CachePtr, POINTER(c_uint64), POINTER(c_uint64), POINTER(c_uint32)], c_int32),
    # expcache_status_t expcache_device_memory_get(expcache_t* cache, uint64_t* out_free, uint64_t* out_total);
    ("expcache_device_memory_get", [CachePtr, POINTER(c_uint64), POINTER(c_uint64)], c_int32),
    # expcache_status_t expcache_select_async(expcache_t* cache, uint32_t layer, const uint32_t* ids, uint32_t k,
    #                                         void* stream, expcache_expert_ptrs_t* out_ptrs);
    ("expcache_select_async", [CachePtr, c_uint32, c_void_p, c_uint32, c_void_p, c_void_p], c_int32),
    # expcache_status_t expcache_select_ids_async(expcache_t* cache, uint32_t layer, const void* ids,
    #                                             uint32_t id_bits, uint32_t k, void* stream,
    #                                             expcache_expert_ptrs_t* out_ptrs);
    ("expcache_select_ids_async", [CachePtr, c_uint32, c_void_p, c_uint32, c_uint32, c_void_p, c_void_p], c_int32),
    # expcache_status_t expcache_select_slots_async(expcache_t* cache, uint32_t layer, const void* ids,
    #                                               uint32_t id_bits, uint32_t k, int32_t* out_slots, void* stream);
    ("expcache_select_slots_async", [CachePtr, c_uint32, c_void_p, c_uint32, c_uint32, c_void_p, c_void_p], c_int32),
    # expcache_status_t expcache_select_split_async(expcache_t* cache, uint32_t layer, const uint32_t* ids,
    #     uint32_t k, void* stream, expcache_expert_ptrs_t* out_ptrs, uint8_t* out_resident, void** out_ready);
    (
        "expcache_select_split_async",
        [CachePtr, c_uint32, c_void_p, c_uint32, c_void_p, c_void_p, c_void_p, POINTER(c_void_p)],
        c_int32,
    ),
    # expcache_status_t expcache_select_split_ids_async(expcache_t* cache, uint32_t layer, const void* ids,
    #     uint32_t id_bits, uint32_t k, void* stream, expcache_expert_ptrs_t* out_ptrs, uint8_t* out_resident,
    #     void** out_ready);
    (
        "expcache_select_split_ids_async",
        [CachePtr, c_uint32, c_void_p, c_uint32, c_uint32, c_void_p, c_void_p, c_void_p, POINTER(c_void_p)],
        c_int32,
    ),
    # expcache_status_t expcache_prefetch_ids_async(expcache_t* cache, uint32_t layer, const void* ids,
    #                                               uint32_t id_bits, uint32_t n, void* stream, uint32_t* out_queued);
    (
        "expcache_prefetch_ids_async",
        [CachePtr, c_uint32, c_void_p, c_uint32, c_uint32, c_void_p, POINTER(c_uint32)],
        c_int32,
    ),
    # expcache_status_t expcache_hint_ids(expcache_t* cache, uint32_t layer, const void* ids, uint32_t id_bits,
    #                                     uint32_t n);
    ("expcache_hint_ids", [CachePtr, c_uint32, c_void_p, c_uint32, c_uint32], c_int32),
    # expcache_status_t expcache_compact_load_ids_async(expcache_t* cache, uint32_t layer, const void* ids,
    #     uint32_t id_bits, uint32_t n, void* stream, expcache_compact_t* out);
    (
        "expcache_compact_load_ids_async",
        [CachePtr, c_uint32, c_void_p, c_uint32, c_uint32, c_void_p, POINTER(Compact)],
        c_int32,
    ),
    # expcache_status_t expcache_batch_prepare_ids_async(expcache_t* cache, uint32_t layer, const void* ids,
    #     uint32_t id_bits, uint64_t n, void* stream, uint32_t* out_ids, expcache_expert_ptrs_t* out_ptrs,
    #     uint32_t* out_count, uint64_t* out_batch);
    (
        "expcache_batch_prepare_ids_async",
        [
            CachePtr,
            c_uint32,
            c_void_p,
            c_uint32,
            c_uint64,
            c_void_p,
            c_void_p,
            c_void_p,
            POINTER(c_uint32),
            POINTER(c_uint64),
        ],
        c_int32,
    ),
    # expcache_status_t expcache_insert_async(expcache_t* cache, uint32_t layer, const void* ids, uint32_t id_bits,
    #                                         const float* priorities, uint32_t n, void* stream);
    ("expcache_insert_async", [CachePtr, c_uint32, c_void_p, c_uint32, c_void_p, c_uint32, c_void_p], c_int32),
    # expcache_status_t expcache_class_find(const expcache_t* cache, uint64_t gate_bytes, uint64_t up_bytes,
    #                                       uint64_t down_bytes, uint32_t* out_class);
    ("expcache_class_find", [CachePtr, c_uint64, c_uint64, c_uint64, POINTER(c_uint32)], c_int32),
    # expcache_status_t expcache_class_find_parts(const expcache_t* cache, uint32_t num_parts,
    #     const uint64_t* part_bytes, uint32_t* out_class);
    ("expcache_class_find_parts", [CachePtr, c_uint32, POINTER(c_uint64), POINTER(c_uint32)], c_int32),
    # expcache_status_t expcache_ready_wait_async(expcache_t* cache, void* ready, void* stream);
    ("expcache_ready_wait_async", [CachePtr, c_void_p, c_void_p], c_int32),
    # expcache_status_t expcache_prefetch_async(expcache_t* cache, uint32_t layer, const uint32_t* ids,
    #                                           uint32_t n, void* stream, uint32_t* out_queued);
    ("expcache_prefetch_async", [CachePtr, c_uint32, c_void_p, c_uint32, c_void_p, POINTER(c_uint32)], c_int32),
    # expcache_status_t expcache_prefetch_wait(expcache_t* cache);
    ("expcache_prefetch_wait", [CachePtr], c_int32),
    # expcache_status_t expcache_hint(expcache_t* cache, uint32_t layer, const uint32_t* ids, uint32_t n);
    ("expcache_hint", [CachePtr, c_uint32, c_void_p, c_uint32], c_int32),
    # expcache_status_t expcache_compact_load_async(expcache_t* cache, uint32_t layer, const uint32_t* ids, uint32_t n,
    #                                               void* stream, expcache_compact_t* out);
    ("expcache_compact_load_async", [CachePtr, c_uint32, c_void_p, c_uint32, c_void_p, POINTER(Compact)], c_int32),
    # expcache_status_t expcache_batch_prepare_async(expcache_t* cache, uint32_t layer, const uint32_t* ids, uint64_t n,
    #     void* stream, uint32_t* out_ids, expcache_expert_ptrs_t* out_ptrs, uint32_t* out_count, uint64_t* out_batch);
    (
        "expcache_batch_prepare_async",
        [CachePtr, c_uint32, c_void_p, c_uint64, c_void_p, c_void_p, c_void_p, POINTER(c_uint32), POINTER(c_uint64)],
        c_int32,
    ),
    # expcache_status_t expcache_batch_prepare_slots_async(expcache_t* cache, uint32_t layer, const void* ids,
    #     uint32_t id_bits, uint64_t n, void* stream, uint32_t* out_ids, int32_t* out_slots, uint32_t* out_count,
    #     uint64_t* out_batch);
    (
        "expcache_batch_prepare_slots_async",
        [
            CachePtr,
            c_uint32,
            c_void_p,
            c_uint32,
            c_uint64,
            c_void_p,
            c_void_p,
            c_void_p,
            POINTER(c_uint32),
            POINTER(c_uint64),
        ],
        c_int32,
    ),
    # expcache_status_t expcache_batch_finish(expcache_t* cache, uint64_t batch, void* stream);
    ("expcache_batch_finish", [CachePtr, c_uint64, c_void_p], c_int32),
    # expcache_status_t expcache_release_all(expcache_t* cache);
    ("expcache_release_all", [CachePtr], c_int32),
    # expcache_status_t expcache_synchronize(expcache_t* cache, void* stream);
    ("expcache_synchronize", [CachePtr, c_void_p], c_int32),
    # expcache_status_t expcache_class_bank_get(expcache_t* cache, uint32_t class_index, expcache_bank_t* out);
    ("expcache_class_bank_get", [CachePtr, c_uint32, POINTER(Bank)], c_int32),
    # expcache_status_t expcache_select_device_async(expcache_t* cache, uint32_t layer, const void* ids,
    #                                                uint32_t id_bits, uint32_t n, uint32_t k, int32_t* out_slots,
    #                                                void* stream);
    (
        "expcache_select_device_async",
        [CachePtr, c_uint32, c_void_p, c_uint32, c_uint32, c_uint32, c_void_p, c_void_p],
        c_int32,
    ),
    # expcache_status_t expcache_select_device_counted_async(expcache_t* cache, uint32_t layer, const void* ids,
    #                                                        uint32_t id_bits, uint32_t n, uint32_t k,
    #                                                        int32_t* out_slots, uint32_t* out_counts, void* stream);
    (
        "expcache_select_device_counted_async",
        [CachePtr, c_uint32, c_void_p, c_uint32, c_uint32, c_uint32, c_void_p, c_void_p, c_void_p],
        c_int32,
    ),
    # expcache_status_t expcache_class_count_get(const expcache_t* cache, uint32_t* out_count);
    ("expcache_class_count_get", [CachePtr, POINTER(c_uint32)], c_int32),
    # expcache_status_t expcache_class_info_get(const expcache_t* cache, uint32_t class_index,
    #                                           expcache_class_info_t* out);
    ("expcache_class_info_get", [CachePtr, c_uint32, POINTER(ClassInfo)], c_int32),
    # expcache_status_t expcache_stats_read(const expcache_t* cache, uint32_t num_classes,
    #                                       expcache_class_info_t* infos, expcache_stats_t* stats);
    ("expcache_stats_read", [CachePtr, c_uint32, POINTER(ClassInfo), POINTER(Stats)], c_int32),
    # expcache_status_t expcache_layer_bind_class(expcache_t* cache, uint32_t layer, uint32_t* out_class);
    ("expcache_layer_bind_class", [CachePtr, c_uint32, POINTER(c_uint32)], c_int32),
    # const char* expcache_path_name(uint32_t path);
    ("expcache_path_name", [c_uint32], c_char_p),
    # expcache_status_t expcache_stats_get(const expcache_t* cache, uint32_t class_index, uint32_t path,
    #                                      expcache_stats_t* out);
    ("expcache_stats_get", [CachePtr, c_uint32, c_uint32, POINTER(Stats)], c_int32),
    # expcache_status_t expcache_staging_stats_get(const expcache_t* cache, expcache_staging_stats_t* out);
    ("expcache_staging_stats_get", [CachePtr, POINTER(StagingStats)], c_int32),
    # expcache_status_t expcache_prefetch_stats_get(const expcache_t* cache, expcache_prefetch_stats_t* out);
    ("expcache_prefetch_stats_get", [CachePtr, POINTER(PrefetchStats)], c_int32),
    # expcache_status_t expcache_pool_stats_get(const expcache_t* cache, expcache_pool_stats_t* out);
    ("expcache_pool_stats_get", [CachePtr, POINTER(PoolStats)], c_int32),
    # expcache_status_t expcache_stats_reset(expcache_t* cache);
    ("expcache_stats_reset", [CachePtr], c_int32),
    # expcache_status_t expcache_memory_retain(expcache_t* cache, const void* ptr, expcache_memory_ref_t** out_ref);
    ("expcache_memory_retain", [CachePtr, c_void_p, POINTER(MemoryRefPtr)], c_int32),
    # void expcache_memory_release(expcache_memory_ref_t* ref);
    ("expcache_memory_release", [MemoryRefPtr], None),
    # expcache_status_t expcache_memory_set_dropped_callback(expcache_t* cache, expcache_memory_dropped_fn fn,
    #                                                        void* user);
    ("expcache_memory_set_dropped_callback", [CachePtr, DROPPED_FN, c_void_p], c_int32),
    # expcache_status_t expcache_log_set_callback(expcache_t* cache, expcache_log_fn fn, void* user);
    ("expcache_log_set_callback", [CachePtr, LOG_FN, c_void_p], c_int32),
    # expcache_status_t expcache_log_set_level(expcache_t* cache, uint32_t level);
    ("expcache_log_set_level", [CachePtr, c_uint32], c_int32),
    # expcache_testing.h:
    # expcache_status_t expcache_testing_read_resident(expcache_t* cache, uint32_t layer, uint32_t expert,
    #                                                  void* dst, uint64_t dst_bytes, uint32_t* out_resident);
    ("expcache_testing_read_resident", [CachePtr, c_uint32, c_uint32, c_void_p, c_uint64, POINTER(c_uint32)], c_int32),
    # expcache_status_t expcache_testing_read_device(expcache_t* cache, const void* src, void* dst, uint64_t n);
    ("expcache_testing_read_device", [CachePtr, c_void_p, c_void_p, c_uint64], c_int32),
    # expcache_status_t expcache_testing_checksum(expcache_t* cache, uint32_t layer,
    #                                             const expcache_expert_ptrs_t* ptrs, uint32_t n,
    #                                             void* stream, uint64_t* out_sums);
    ("expcache_testing_checksum", [CachePtr, c_uint32, c_void_p, c_uint32, c_void_p, c_void_p], c_int32),
    # expcache_status_t expcache_testing_checksum_async(expcache_t* cache, uint32_t layer,
    #                                                   const expcache_expert_ptrs_t* ptrs, uint32_t n,
    #                                                   void* stream, uint32_t first);
    ("expcache_testing_checksum_async", [CachePtr, c_uint32, c_void_p, c_uint32, c_void_p, c_uint32], c_int32),
    # expcache_status_t expcache_testing_bank_checksum_async(expcache_t* cache, uint32_t layer, const int32_t* slots,
    #                                                        uint32_t n, void* stream, uint32_t first);
    ("expcache_testing_bank_checksum_async", [CachePtr, c_uint32, c_void_p, c_uint32, c_void_p, c_uint32], c_int32),
    # expcache_status_t expcache_testing_bank_checksum_host_slots_async(expcache_t* cache, uint32_t layer,
    #                                                                   const int32_t* slots, uint32_t n,
    #                                                                   void* stream, uint32_t first);
    (
        "expcache_testing_bank_checksum_host_slots_async",
        [CachePtr, c_uint32, c_void_p, c_uint32, c_void_p, c_uint32],
        c_int32,
    ),
    # expcache_status_t expcache_testing_checksum_results(expcache_t* cache, uint32_t first, uint32_t n,
    #                                                     uint64_t* out);
    ("expcache_testing_checksum_results", [CachePtr, c_uint32, c_uint32, c_void_p], c_int32),
    # expcache_status_t expcache_testing_inject_alloc_failures(expcache_t* cache, uint64_t skip, uint64_t count);
    ("expcache_testing_inject_alloc_failures", [CachePtr, c_uint64, c_uint64], c_int32),
    # expcache_status_t expcache_testing_inject_copy_failures(expcache_t* cache, uint64_t skip, uint64_t count);
    ("expcache_testing_inject_copy_failures", [CachePtr, c_uint64, c_uint64], c_int32),
    # expcache_status_t expcache_testing_inject_staging_failures(expcache_t* cache, uint64_t skip, uint64_t count);
    ("expcache_testing_inject_staging_failures", [CachePtr, c_uint64, c_uint64], c_int32),
    # expcache_status_t expcache_testing_prefetch_pause(expcache_t* cache, uint32_t paused);
    ("expcache_testing_prefetch_pause", [CachePtr, c_uint32], c_int32),
    # expcache_status_t expcache_testing_spin_async(expcache_t* cache, void* stream, uint64_t ns);
    ("expcache_testing_spin_async", [CachePtr, c_void_p, c_uint64], c_int32),
    # expcache_status_t expcache_testing_device_bytes_in_use(const expcache_t* cache, uint64_t* out_bytes);
    ("expcache_testing_device_bytes_in_use", [CachePtr, POINTER(c_uint64)], c_int32),
    # expcache_status_t expcache_testing_table_reads(expcache_t* cache, uint32_t layer, uint64_t* out_count);
    ("expcache_testing_table_reads", [CachePtr, c_uint32, POINTER(c_uint64)], c_int32),
    # expcache_status_t expcache_testing_device_reads(const expcache_t* cache, uint64_t* out_syncs,
    #                                                 uint64_t* out_copies);
    ("expcache_testing_device_reads", [CachePtr, POINTER(c_uint64), POINTER(c_uint64)], c_int32),
    # uint32_t expcache_testing_struct_size(uint32_t which);
    ("expcache_testing_struct_size", [c_uint32], c_uint32),
]
