/*
 * expcache_testing.h — hooks for tests, benchmarks and bindings; not part of
 * the production ABI's stability promise. They may change or go in any
 * release; an engine serving a model needs only expcache.h.
 *
 * Every hook is named expcache_testing_<object>_<verb> (or _<verb>), follows
 * expcache.h's conventions (statuses, out-pointers last, INVALID_ARGUMENT on
 * a NULL or destroyed handle and on a NULL where a pointer is required) and
 * is exported by the same library.
 */
#ifndef EXPCACHE_TESTING_H
#define EXPCACHE_TESTING_H

#include "expcache.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------- */
/* Reading back                                                            */
/* ---------------------------------------------------------------------- */

/**
 * Copy the resident bytes of expert (layer, expert) to host memory dst
 * (dst_bytes, at least gate+up+down bytes; gate, then up, then down).
 * Synchronous: waits for the copy. *out_resident is set to 1 and dst filled
 * when the expert is resident, else 0 and dst untouched. Status:
 * INVALID_ARGUMENT (layer or expert out of range, dst_bytes too small),
 * INVALID_STATE (layer not registered), CUDA, POISONED.
 */
EXPCACHE_API expcache_status_t expcache_testing_read_resident(expcache_t* cache, uint32_t layer, uint32_t expert,
                                                              void* dst, uint64_t dst_bytes, uint32_t* out_resident);

/**
 * Copy n bytes (> 0) of device memory at src, which must lie inside memory
 * this cache allocated (an address it handed out), to host memory dst.
 * Synchronous: waits for the copy. Status: INVALID_ARGUMENT (n 0, or
 * [src, src + n) not inside this cache's memory), CUDA, POISONED.
 */
EXPCACHE_API expcache_status_t expcache_testing_read_device(expcache_t* cache, const void* src, void* dst, uint64_t n);

/* ---------------------------------------------------------------------- */
/* Checksums                                                               */
/* ---------------------------------------------------------------------- */

/**
 * Checksum kernel: for each expert i of ptrs[0..n) (n 1..2^20; parts of the
 * sizes of `layer`'s class, inside memory this cache allocated), read every
 * byte and write to out_sums[i] (host memory) the sum over parts p and
 * 64-bit little-endian words w_j (tail zero-padded) of w_j * (2j + 1),
 * modulo 2^64, with j counted from the start of each part. The memory-bound
 * floor of the expert GEMVs; used to verify served bytes. Enqueued on
 * `stream`, then synchronizes `stream`. Status: INVALID_ARGUMENT (layer out
 * of range, n out of range, a part outside this cache's memory),
 * INVALID_STATE (layer not registered), CUDA, POISONED.
 */
EXPCACHE_API expcache_status_t expcache_testing_checksum(expcache_t* cache, uint32_t layer,
                                                         const expcache_expert_ptrs_t* ptrs, uint32_t n, void* stream,
                                                         uint64_t* out_sums);

/** Result slots of expcache_testing_checksum_async, per cache. */
#define EXPCACHE_CHECKSUM_RESULTS 65536

/**
 * expcache_testing_checksum without waiting: enqueued on `stream`, the sums
 * land in the cache's result slots [first, first + n) (within
 * EXPCACHE_CHECKSUM_RESULTS) when the stream reaches the kernel (the host
 * backend computes them before returning). Read them with
 * expcache_testing_checksum_results after synchronizing the stream. Lets an
 * engine run layer after layer without a host synchronization between
 * them. Status: as expcache_testing_checksum, and INVALID_ARGUMENT when the
 * slots run past EXPCACHE_CHECKSUM_RESULTS.
 */
EXPCACHE_API expcache_status_t expcache_testing_checksum_async(expcache_t* cache, uint32_t layer,
                                                               const expcache_expert_ptrs_t* ptrs, uint32_t n,
                                                               void* stream, uint32_t first);

/**
 * The checksum kernel over a class's bank: the experts in slots slots[0..n)
 * (device memory, int32; host memory on the host backend) of `layer`'s bank,
 * each summed over every one of its parts (1..EXPCACHE_MAX_PARTS, as
 * expcache_testing_checksum's rule) into result slot first + i (0 for a slot
 * outside the bank's slots and its mapped staging and batch rows), as
 * expcache_testing_checksum_async's. The slot ids are read by the kernel, so
 * this can follow expcache_select_device_async inside a captured graph (call it
 * once outside the capture first: its scratch is allocated then). The
 * benchmark's graph loop reads every routed expert this way. Any cache whose
 * layer's class has slots (a host-lookup cache's slots from
 * expcache_select_slots_async are in host memory: see
 * expcache_testing_bank_checksum_host_slots_async). Status: INVALID_ARGUMENT
 * (n 0 or over EXPCACHE_MAX_SELECT, slots past EXPCACHE_CHECKSUM_RESULTS, NULL
 * slots, layer out of range), INVALID_STATE (layer not registered, or its class
 * not bound or without a slot yet), CUDA, POISONED.
 */
EXPCACHE_API expcache_status_t expcache_testing_bank_checksum_async(expcache_t* cache, uint32_t layer,
                                                                    const int32_t* slots, uint32_t n, void* stream,
                                                                    uint32_t first);

/**
 * expcache_testing_bank_checksum_async with slots[0..n) in host memory, as
 * expcache_select_slots_async and expcache_batch_prepare_slots_async write them
 * (either lookup): the call copies them on `stream` into the cache's scratch of
 * result slots [first, first + n) before the kernel (on the host backend the
 * kernel reads them where they are, at once), so `slots` may be reused once the
 * call returns. Ordered after the work of the serving call on another stream, as
 * expcache_testing_checksum_async is; not for a captured graph. Calls into
 * distinct result slots may be in flight together; reuse result slots, on any
 * stream, only once the earlier call's stream has finished (as reading their
 * sums needs: the slots are staged at the result slots' place). The
 * benchmark's C loop reads the experts of layers of other than three parts this
 * way. Status: as expcache_testing_bank_checksum_async.
 */
EXPCACHE_API expcache_status_t expcache_testing_bank_checksum_host_slots_async(expcache_t* cache, uint32_t layer,
                                                                               const int32_t* slots, uint32_t n,
                                                                               void* stream, uint32_t first);

/**
 * Copy result slots [first, first + n) (non-empty, within
 * EXPCACHE_CHECKSUM_RESULTS) to host memory `out` (n uint64_t). Does not
 * wait: synchronize the stream of the expcache_testing_checksum_async calls
 * first. Status: INVALID_ARGUMENT, CUDA, POISONED.
 */
EXPCACHE_API expcache_status_t expcache_testing_checksum_results(expcache_t* cache, uint32_t first, uint32_t n,
                                                                 uint64_t* out);

/* ---------------------------------------------------------------------- */
/* Fault injection and accounting                                          */
/* ---------------------------------------------------------------------- */

/**
 * Fault injection, both backends: let the next `skip` device allocations
 * succeed, then make the following `count` fail as if device memory were
 * exhausted. count 0 disables injection. Takes effect at once. Status:
 * INVALID_ARGUMENT.
 */
EXPCACHE_API expcache_status_t expcache_testing_inject_alloc_failures(expcache_t* cache, uint64_t skip, uint64_t count);

/**
 * Fault injection, both backends: let the next `skip` copies (host to device
 * or device to device) be issued, then make the following `count` fail with
 * EXPCACHE_ERR_CUDA as if the copy had been refused. The failing call leaves
 * no slot marked resident that does not hold its expert. count 0 disables.
 * Takes effect at once. Status: INVALID_ARGUMENT.
 */
EXPCACHE_API expcache_status_t expcache_testing_inject_copy_failures(expcache_t* cache, uint64_t skip, uint64_t count);

/**
 * Fault injection, both backends: let the next `skip` staged pieces (the
 * pieces of pageable and file uploads, filled on the staging threads) be
 * filled, then make the following `count` fail on those threads with
 * EXPCACHE_ERR_CUDA, as a failed transfer would. The call that staged them
 * fails, and none of the experts it loaded stays resident. count 0 disables.
 * Takes effect at once. Status: INVALID_ARGUMENT.
 */
EXPCACHE_API expcache_status_t expcache_testing_inject_staging_failures(expcache_t* cache, uint64_t skip,
                                                                        uint64_t count);

/**
 * Write the device bytes this cache currently has allocated (slots and
 * staging buffers, as allocated, not rounded) to *out_bytes. Status:
 * INVALID_ARGUMENT.
 */
EXPCACHE_API expcache_status_t expcache_testing_device_bytes_in_use(const expcache_t* cache, uint64_t* out_bytes);

/**
 * Prefetch, both backends: while paused (1), the prefetch thread sends no
 * piece, so what expcache_prefetch_async queued stays queued until a serving
 * call cancels it or the pause ends (0): tests make cancellation certain
 * (expcache_prefetch_wait makes completion certain, and refuses while paused).
 * Status: INVALID_ARGUMENT.
 */
EXPCACHE_API expcache_status_t expcache_testing_prefetch_pause(expcache_t* cache, uint32_t paused);

/**
 * Benchmarks, both backends: `ns` nanoseconds (at most 1 s) of work that only
 * takes time, enqueued on `stream` (one GPU thread spinning on the global
 * timer; the host backend spins on the calling thread before returning): an
 * engine's non-expert work of a layer. Status: INVALID_ARGUMENT, CUDA.
 */
EXPCACHE_API expcache_status_t expcache_testing_spin_async(expcache_t* cache, void* stream, uint64_t ns);

/**
 * Device lookup, both backends: write to *out_count how many device selects
 * of `layer`'s class (expcache_select_device_async) were served by their table
 * read since the class was bound: every id in range was resident, so the
 * select refreshed the hits and counted, with no victim search and nothing to
 * copy (a class whose bank holds every expert of its layers is always served
 * so). 0 when the class is not bound. Synchronizes the device. Status:
 * INVALID_ARGUMENT (layer not registered), INVALID_STATE (not a device-lookup
 * cache), CUDA, POISONED.
 */
EXPCACHE_API expcache_status_t expcache_testing_table_reads(expcache_t* cache, uint32_t layer, uint64_t* out_count);

/**
 * Both backends: the device synchronizations (*out_syncs) and synchronous
 * device-to-host copies (*out_copies) the cache has made since it was created,
 * as its backend counts them (the checks that a call reads the device once).
 * Status: INVALID_ARGUMENT (NULL outputs).
 */
EXPCACHE_API expcache_status_t expcache_testing_device_reads(const expcache_t* cache, uint64_t* out_syncs,
                                                             uint64_t* out_copies);

/* ---------------------------------------------------------------------- */
/* Struct sizes, for bindings to check their mirrors                       */
/* ---------------------------------------------------------------------- */

#define EXPCACHE_STRUCT_CONFIG 0         /**< expcache_config_t */
#define EXPCACHE_STRUCT_LAYER_DESC 1     /**< expcache_layer_desc_t */
#define EXPCACHE_STRUCT_EXPERT_PTRS 2    /**< expcache_expert_ptrs_t */
#define EXPCACHE_STRUCT_COMPACT 3        /**< expcache_compact_t */
#define EXPCACHE_STRUCT_CLASS_INFO 4     /**< expcache_class_info_t */
#define EXPCACHE_STRUCT_STATS 5          /**< expcache_stats_t */
#define EXPCACHE_STRUCT_STAGING_STATS 6  /**< expcache_staging_stats_t */
#define EXPCACHE_STRUCT_PREFETCH_STATS 7 /**< expcache_prefetch_stats_t */
#define EXPCACHE_STRUCT_BANK 8           /**< expcache_bank_t */
#define EXPCACHE_STRUCT_POOL_STATS 9     /**< expcache_pool_stats_t */
#define EXPCACHE_STRUCT_COUNT 10         /**< the number of EXPCACHE_STRUCT_* values */

/**
 * sizeof, in bytes, of the public struct `which` (EXPCACHE_STRUCT_*) as the
 * library was compiled; 0 for an unknown `which`. Never fails, touches no
 * cache, callable from any thread.
 */
EXPCACHE_API uint32_t expcache_testing_struct_size(uint32_t which);

#ifdef __cplusplus
}
#endif

#endif /* EXPCACHE_TESTING_H */
