/*
 * expcache.h — the public header of libexpcache, a GPU expert cache for
 * streaming Mixture-of-Experts inference (the hooks for tests, benchmarks
 * and bindings are in expcache_testing.h).
 *
 * An engine that cannot keep every routed expert in device memory registers
 * where each layer's experts live on the host, then asks the cache, layer by
 * layer, for the device addresses of the experts its router selected. The
 * cache keeps one bank of slots per expert byte-size class (so a model that
 * mixes quantizations never thrashes), evicts by its policy (duel by default,
 * LRU, OppClassLRU) on the single-token decode path, on the host or inside a
 * device select, lets prefill batches read it and append into free capacity
 * without ever evicting, and builds compact staging buffers for batched
 * kernels, releasing the cache only when device memory is really short.
 *
 * Naming: expcache_<verb> acts on the cache handle itself (create, select_async, release_all, ...),
 * expcache_<object>_<verb> on the rest (layer_register, stats_get); _async: stream-ordered; _get: getter.
 *
 * Conventions
 *  - Every function that can fail returns an expcache_status_t (0 = OK).
 *    Results are written through out-pointers, placed last. On failure the
 *    out-pointers are left untouched and the cache stays consistent: every
 *    slot marked resident holds exactly its expert's bytes. Every function
 *    taking a cache fails with INVALID_ARGUMENT on a NULL or destroyed
 *    handle and on a NULL where a pointer is required (a NULL stream is
 *    the default stream); each function's Status line lists the rest.
 *  - Functions without _async finish their work before they return (only
 *    expcache_batch_finish defers a free to its stream); those that also
 *    wait for device work say so. Sizes are in bytes and capacities in
 *    experts unless a name or comment says otherwise.
 *  - expcache_status_string() names a status; expcache_last_error() gives
 *    the detail of the calling thread's last failure (function, reason, CUDA
 *    error name). Nothing aborts, exits or throws across this ABI.
 *  - Structs use fixed-width integers only and begin with their own size,
 *    which the caller sets (the *_init functions do it).
 *  - Functions ending in _async enqueue device work on the caller's stream
 *    and return before it completes. `stream` is a cudaStream_t passed as
 *    void*; NULL is the legacy default stream. Streams are borrowed, never
 *    destroyed. The host backend ignores streams and completes copies
 *    before returning. Which streams, and what each costs:
 *      - the legacy default stream (NULL, cudaStreamLegacy): every call works.
 *        A call's uploads from pinned memory go one by one there, because
 *        cudaMemcpyBatchAsync refuses that stream (a few microseconds of link
 *        time per contiguous part); elsewhere they go together in one batch.
 *        It cannot be captured into a graph (CUDA's rule), and while another
 *        stream is being captured a call on it is treated as captured (no
 *        class binding then). An engine that runs everything on it (ds4) gets
 *        the batched uploads back by creating one blocking stream of its own
 *        and passing that.
 *      - cudaStreamPerThread and streams the caller created, blocking or
 *        non-blocking: every call works, with batched uploads. A blocking
 *        stream also waits for the legacy stream, as CUDA orders it; the
 *        library orders its own work only by the streams it is given.
 *      - the library's own copy stream (split selects' misses, prefetch
 *        pieces) is non-blocking: the caller's stream waits for it only
 *        through expcache_ready_wait_async and the cache's own events.
 *    Calls on one cache from unordered streams must not touch the same
 *    experts at once (each function says what stays valid until when).
 *  - Ownership: the library never frees caller memory, and it reads the
 *    caller's memory until expcache_destroy returns: the host expert bytes
 *    registered with a layer (pinned or pageable) must stay mapped, valid
 *    and unchanged until then, and a file opened with expcache_file_open
 *    must not shrink. Freeing or unmapping them earlier makes later misses
 *    copy freed memory (wrong bytes or a crash); the library cannot detect
 *    it. Device pointers handed out stay valid only as long as each
 *    function's comment says.
 *  - Thread safety: one cache may be used from several threads; calls on
 *    one cache are serialized by an internal mutex. Separate caches are
 *    independent. Device pointers returned to one thread can be invalidated
 *    by another thread's next call on the same cache, so an engine that
 *    shares a cache between threads orders its own calls. expcache_destroy
 *    is the exception: no other call on the same cache may be in flight or
 *    start while it runs (a call that starts after it returns gets
 *    INVALID_ARGUMENT: the handle is no longer live). Bindings that let
 *    one thread close a cache others use must wait for the calls in flight
 *    first, as pyexpcache's ExpertCache.close() does.
 */
#ifndef EXPCACHE_H
#define EXPCACHE_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define EXPCACHE_API __declspec(dllexport)
#else
#define EXPCACHE_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define EXPCACHE_VERSION_MAJOR 0
#define EXPCACHE_VERSION_MINOR 3
#define EXPCACHE_VERSION_PATCH 0

/* ---------------------------------------------------------------------- */
/* Status codes                                                            */
/* ---------------------------------------------------------------------- */

typedef int32_t expcache_status_t;

#define EXPCACHE_OK 0
/** An argument is NULL, out of range, or inconsistent (the message says which). */
#define EXPCACHE_ERR_INVALID_ARGUMENT 1
/** Device memory (or the host backend's emulated capacity) is exhausted. */
#define EXPCACHE_ERR_OUT_OF_DEVICE_MEMORY 2
/** A host allocation failed. */
#define EXPCACHE_ERR_OUT_OF_HOST_MEMORY 3
/** The call is not valid in the cache's current state (e.g. layer not registered). */
#define EXPCACHE_ERR_INVALID_STATE 4
/** The requested backend is not available (no CUDA device, library built without CUDA). */
#define EXPCACHE_ERR_UNSUPPORTED 5
/** A CUDA call failed; expcache_last_error() names the CUDA error. */
#define EXPCACHE_ERR_CUDA 6
/** A sticky CUDA error happened earlier; the cache refuses further work. Destroy it. */
#define EXPCACHE_ERR_POISONED 7
/** A bug in the library; please report it with expcache_last_error(). */
#define EXPCACHE_ERR_INTERNAL 8
/** Reading a source file failed or came up short; expcache_last_error() names the file and errno. */
#define EXPCACHE_ERR_IO 9

/** Static, never NULL: a short name of a status ("EXPCACHE_ERR_INVALID_ARGUMENT"). */
EXPCACHE_API const char* expcache_status_string(expcache_status_t status);

/**
 * The detail of the calling thread's most recent failure, e.g.
 * "expcache_select_async: expert id 300 out of range for layer 4 (256 experts)".
 * Never NULL; "" when no call has failed on this thread. Valid until the
 * thread's next call into the library.
 */
EXPCACHE_API const char* expcache_last_error(void);

/** Library version as MAJOR*10000 + MINOR*100 + PATCH. */
EXPCACHE_API uint32_t expcache_version(void);

/* ---------------------------------------------------------------------- */
/* Configuration                                                           */
/* ---------------------------------------------------------------------- */

/** Backends (expcache_config_t.backend). */
#define EXPCACHE_BACKEND_AUTO 0 /**< CUDA when a device is usable, else host. */
#define EXPCACHE_BACKEND_HOST 1 /**< Host memory stands in for device memory. */
#define EXPCACHE_BACKEND_CUDA 2 /**< cudaMalloc'd slabs, async copies. */

/* The constants' comments span lines, which clang-format would turn into macro continuations. */
/* clang-format off */
/** Log levels (expcache_config_t.log_level). */
#define EXPCACHE_LOG_SILENT 0
#define EXPCACHE_LOG_WARNING 1 /**< trouble only: a class left with cap 0 (nothing cached: a budget too
                                    small for one of its experts, a reserve above free memory, a failed
                                    slot allocation), once per change, with the fix */
#define EXPCACHE_LOG_NOTICE 2  /**< plus cap changes, class reuse, cache releases (default). */
#define EXPCACHE_LOG_DEBUG 3   /**< plus one line per call. EXPCACHE_VERBOSE=1 sets this. */

/** How file sources are read (expcache_config_t.file_reads). */
#define EXPCACHE_FILE_READS_BUFFERED 0 /**< pread through the page cache: repeated misses of a model that
                                            fits in RAM are served from memory */
#define EXPCACHE_FILE_READS_DIRECT 1   /**< O_DIRECT where the file system allows it (else buffered): for
                                            models larger than RAM, whose streaming would only thrash
                                            the page cache */

/** Eviction policies (expcache_config_t.policy), per class. Ids are 0..EXPCACHE_POLICY_COUNT-1. */
#define EXPCACHE_POLICY_LRU 0      /**< "lru": least recently used */
#define EXPCACHE_POLICY_OPPCLASS 1 /**< "oppclass": decayed use count classes, age in missed opportunities
                                        of the expert's layer (docs/policy.md): more hits than LRU on the
                                        DeepSeek traces, most at small budgets; fewer where popularity
                                        shifts */
#define EXPCACHE_POLICY_DUEL 2     /**< "duel", the default: LRU and OppClassLRU both order the slots, the
                                        one whose victims go chosen online from two shadow caches (set
                                        dueling; docs/policy.md): within 0.5 points of LRU on every trace
                                        measured, most of OppClassLRU's gain where it has one */
#define EXPCACHE_POLICY_COUNT 3    /**< the number of EXPCACHE_POLICY_* values */

/** How a class's slots are shared among its layers (expcache_config_t.partition). */
#define EXPCACHE_PARTITION_GLOBAL 0 /**< a miss may evict any slot of its class (default) */
#define EXPCACHE_PARTITION_LAYER 1  /**< each layer its own share of its class's slots: the class's runtime
                                         cap split over the class's registered layers in proportion to their
                                         experts (rounded down, the slots left over one each to the layers
                                         of the largest remainders, ties to the lower layer). A miss of a
                                         layer holding its share evicts the policy's victim among that
                                         layer's slots; below its share it takes a free or new slot (and,
                                         when the cap allows none, the victim among the class's slots).
                                         Batches append only below the layer's share */

/** Where a cache looks experts up (expcache_config_t.lookup). */
/* expcache_config_t.environment. READ: expcache_create reads EXPCACHE_RESERVE_GB,
 * EXPCACHE_VERBOSE and the staging ring's EXPCACHE_STAGING_* knobs (an operator's
 * overrides). A malformed value never fails create: it is ignored, with a warning. A
 * value that replaces one the caller set explicitly (a reserve_bytes or log_level other
 * than the default) is logged as a notice. Each such line is logged once per process.
 * IGNORE: no variable is read; the config is what the cache runs with (an engine that
 * computes its own reserve). */
#define EXPCACHE_ENVIRONMENT_READ 0
#define EXPCACHE_ENVIRONMENT_IGNORE 1

#define EXPCACHE_LOOKUP_HOST 0   /**< the host: expcache_select_async and the other serving calls */
#define EXPCACHE_LOOKUP_DEVICE 1 /**< the device too: slot banks and expcache_select_device_async */

/**
 * How a class's bank lays its rows out (expcache_config_t.bank_arrangement; see expcache_bank_t).
 * Either way part p of slot s is at base + part_offset[p] + s * part_stride[p].
 */
#define EXPCACHE_BANK_SLOTS 0 /**< slot-major (default): each slot holds every part of its expert side by side */
#define EXPCACHE_BANK_PARTS 1 /**< part-major: a region per part, [rows, part] contiguous when the part's bytes
                                   are a multiple of 256; what a kernel taking one [experts, ...] tensor per
                                   projection wants (ggml's mul_mat_id, FP8 kernels asserting contiguity) */
/* clang-format on */

/**
 * The name of eviction policy `policy` (EXPCACHE_POLICY_*): "lru", "oppclass", the lower-case
 * tail of its constant, as pyexpcache and its simulator name it. Static; NULL for an id that is
 * not a policy of this library (ids are dense, so a binding lists the policies by calling it
 * from 0 until NULL). Never fails (no status), touches no cache, callable from any thread.
 */
EXPCACHE_API const char* expcache_policy_name(uint32_t policy);

/** Most size classes one cache can hold. */
#define EXPCACHE_MAX_CLASSES_LIMIT 64
/** Most layers one cache can hold. */
#define EXPCACHE_MAX_LAYERS_LIMIT 4096
/** Most experts one layer can have. */
#define EXPCACHE_MAX_EXPERTS_LIMIT 65536
/** Largest part of one expert (gate, up, down, or any of expcache_layer_desc_t.parts), in bytes (2^40). */
#define EXPCACHE_MAX_PART_BYTES_LIMIT 1099511627776ULL
/** Most parts one expert has (expcache_layer_desc_t.num_parts). */
#define EXPCACHE_MAX_PARTS 8

/**
 * expcache_config_t.budget_bytes (and expcache_budget_set's): the budget sizes itself from the
 * device. expcache_create takes the device's free memory less reserve_bytes as the total budget
 * (the host backend: its emulated device), shared between classes as an explicit budget_bytes
 * is, and logs a notice with the three figures; expcache_budget_set with it measures again (the
 * cache's own slots counted as free), and so does expcache_reserve_set while it is in force. An
 * engine puts what it needs beside the experts (its weights are loaded already; its KV cache,
 * activations and a margin) into reserve_bytes. expcache_budget_get says what it came to.
 */
#define EXPCACHE_BUDGET_FREE_MEMORY UINT64_MAX

/** Largest expcache_config_t.host_budget_bytes (2^48, 256 TiB). */
#define EXPCACHE_MAX_HOST_BUDGET_BYTES 281474976710656ULL

/**
 * Cache configuration. Fill with expcache_config_init(), then change fields.
 *
 * Budgets: a class's target capacity is the smallest of
 *   - budget_experts (per class, in experts; 0 = no limit from this field),
 *   - its share of budget_bytes (total over all classes, in bytes; 0 = no
 *     limit from this field), shared between classes in proportion to the
 *     bytes of all their experts, so each class may cache the same fraction
 *     of its experts,
 *   - the number of experts in the class.
 * Its runtime cap is the target limited by free device memory minus
 * reserve_bytes (and minus what other classes may still grow into); slots
 * are allocated lazily, slab by slab, up to the cap. At least one of the two
 * budgets must be set.
 */
typedef struct expcache_config_t {
    uint32_t struct_size;            /**< sizeof(expcache_config_t) */
    uint32_t backend;                /**< EXPCACHE_BACKEND_*; default AUTO */
    int32_t device;                  /**< CUDA device ordinal; default 0 */
    uint32_t num_layers;             /**< layers are 0..num_layers-1; required, 1..EXPCACHE_MAX_LAYERS_LIMIT */
    uint32_t max_classes;            /**< default 4; 1..EXPCACHE_MAX_CLASSES_LIMIT */
    uint32_t log_level;              /**< EXPCACHE_LOG_*; default NOTICE. The environment variable EXPCACHE_VERBOSE
                                          (read by expcache_create unless environment is IGNORE) raises it to DEBUG
                                          when 1, true, yes or on, leaves it when 0, false, no or off (any case);
                                          any other value is ignored with a warning */
    uint64_t budget_experts;         /**< per-class budget in experts; default 0 (unset) */
    uint64_t budget_bytes;           /**< total budget in bytes; default 0 (unset); EXPCACHE_BUDGET_FREE_MEMORY:
                                          free device memory less reserve_bytes, measured by expcache_create */
    uint64_t reserve_bytes;          /**< device memory the expert caches never grow into (left for staging
                                          buffers and the engine); default 1 GiB; EXPCACHE_RESERVE_GB overrides (see
                                          EXPCACHE_ENVIRONMENT_READ) */
    uint64_t device_capacity_bytes;  /**< host backend only: emulated device size; default 64 GiB */
    uint64_t slab_bytes;             /**< largest single slot allocation; default 512 MiB (at least one slot) */
    uint32_t copy_threads;           /**< pageable and file sources: threads filling the pinned staging ring, whole
                                          chunks each, while the calling thread sends the filled ones in order
                                          (counted among them: copy_threads - 1 workers are started); default the
                                          cores the process may use (its CPU affinity) less 4, at least 2, at
                                          most 12; 0 = plain pageable copies, and files read by the calling
                                          thread alone */
    uint32_t policy;                 /**< EXPCACHE_POLICY_*; default DUEL */
    uint64_t staging_bytes;          /**< pageable and file sources: size of the pinned staging ring; default
                                          64 MiB; 1 MiB..16 GiB */
    uint64_t staging_chunk_bytes;    /**< largest piece one thread fills and one transfer moves; default 512 KiB;
                                       64 KiB..64 MiB, a multiple of 4096 (a ring smaller than 2 chunks uses
                                       smaller ones) */
    uint32_t file_reads;             /**< EXPCACHE_FILE_READS_*; default BUFFERED */
    uint32_t prefetch_max_per_layer; /**< most experts of one layer queued by expcache_prefetch_async
                                    between two serving calls of that layer; default 8; 0 turns prefetch
                                    off (every id is counted as dropped); at most EXPCACHE_MAX_SELECT */
    uint64_t prefetch_piece_bytes;   /**< most prefetch bytes in flight at once, sent as two transfers of
                                      half so that one is queued while the other crosses: what a demand
                                      miss shares the link with; default 4 MiB; 4 KiB..64 MiB, a
                                      multiple of 4096 */
    uint32_t lookup;                 /**< EXPCACHE_LOOKUP_*; default HOST. DEVICE: each class's slots are one bank
                                          allocated whole when the class is bound, and expcache_select_device_async
                                          looks experts up on the device (see "Serving from the device"), with
                                          any policy */
    uint32_t partition;              /**< EXPCACHE_PARTITION_GLOBAL (default) or _LAYER; a device lookup needs GLOBAL */
    uint32_t environment;            /**< EXPCACHE_ENVIRONMENT_READ (default) or _IGNORE: whether expcache_create
                                          reads the EXPCACHE_* environment variables (see EXPCACHE_ENVIRONMENT_READ) */
    uint32_t reserved;               /**< must be 0 */
    uint64_t host_budget_bytes;      /**< pageable and file sources: bytes of the host pool, a tier of pinned
                                          host RAM between the source and the device cache, its evictions
                                          ordered by `policy` as the classes' are (see "The host pool" at
                                          expcache_pool_stats_t); default 0 = no pool; at most
                                          EXPCACHE_MAX_HOST_BUDGET_BYTES. Allocated by expcache_create */
    uint32_t bank_arrangement;       /**< EXPCACHE_BANK_SLOTS (default) or _PARTS: how each class's bank lays out
                                          its rows (see expcache_bank_t) */
    uint32_t reserved2;              /**< must be 0 */
} expcache_config_t;

/** Fill *config with defaults and set struct_size. Fails only on NULL. */
EXPCACHE_API expcache_status_t expcache_config_init(expcache_config_t* config);

/* ---------------------------------------------------------------------- */
/* Cache lifetime                                                          */
/* ---------------------------------------------------------------------- */

typedef struct expcache_t expcache_t;

/**
 * Create a cache. Allocates no device memory yet. With backend AUTO the
 * CUDA backend is chosen when the library was built with CUDA and the
 * device is usable, else the host backend. Unless config.environment is
 * EXPCACHE_ENVIRONMENT_IGNORE it reads the EXPCACHE_* variables (see
 * EXPCACHE_ENVIRONMENT_READ), none of which can fail it. Status: INVALID_ARGUMENT
 * (a config field), UNSUPPORTED (CUDA asked for and unavailable),
 * OUT_OF_HOST_MEMORY, CUDA.
 */
EXPCACHE_API expcache_status_t expcache_create(const expcache_config_t* config, expcache_t** out_cache);

/**
 * Destroy a cache: waits for the device work this cache enqueued, frees
 * every slot and staging buffer. NULL is accepted and ignored. All device
 * pointers the cache handed out become invalid, except inside memory that
 * an expcache_memory_ref_t keeps alive (below).
 *
 * fork(): a cache belongs to the process that created it. In a child made
 * by fork() its threads do not exist and its locks and CUDA state are the
 * parent's, so every call on it fails with INVALID_STATE ("created before
 * this process forked"; create a new cache in the child), and
 * expcache_destroy in the child only forgets the handle: it touches no
 * thread, lock or device state, and leaks the rest deliberately (the
 * child's copy of it). The parent's cache is unaffected.
 */
EXPCACHE_API void expcache_destroy(expcache_t* cache);

/**
 * Write the backend actually in use (EXPCACHE_BACKEND_HOST or _CUDA) to
 * *out_backend. Status: INVALID_ARGUMENT.
 */
EXPCACHE_API expcache_status_t expcache_backend_get(const expcache_t* cache, uint32_t* out_backend);

/* ---------------------------------------------------------------------- */
/* Model layout                                                            */
/* ---------------------------------------------------------------------- */

/** Where a layer's host bytes live (expcache_layer_desc_t.source_kind). */
#define EXPCACHE_SOURCE_PAGEABLE 0 /**< ordinary host memory (malloc, mmap) */
#define EXPCACHE_SOURCE_PINNED 1   /**< page-locked host memory (cudaMallocHost, cudaHostRegister) */
#define EXPCACHE_SOURCE_FILE 2     /**< a file opened with expcache_file_open (models larger than RAM) */

/**
 * One part of a layer's experts: expert e's bytes of it are at base + e*stride
 * and are `bytes` long (a contiguous [experts][bytes] tensor has stride ==
 * bytes), or, with `offsets`, at base + offsets[e] (a checkpoint that keeps each
 * expert's tensor apart, in whatever order its writer chose). With
 * EXPCACHE_SOURCE_FILE, base and the offsets are byte offsets into the layer's
 * file (base cast to a pointer; 0 is a valid offset), or, with `files`, into
 * file files[e] (a checkpoint of several shards). The library copies both
 * arrays when the layer is registered.
 */
typedef struct expcache_part_t {
    uint64_t bytes;          /**< 1..EXPCACHE_MAX_PART_BYTES_LIMIT */
    uint64_t stride;         /**< bytes between experts, at least `bytes`; must be 0 with offsets */
    const void* base;        /**< expert 0's part, or where the offsets count from */
    const uint64_t* offsets; /**< NULL, or num_experts offsets from base, one per expert */
    const uint32_t* files;   /**< EXPCACHE_SOURCE_FILE only: NULL (every expert in the layer's `file`), or
                                  num_experts ids from expcache_file_open, one per expert */
} expcache_part_t;

/**
 * One MoE layer. Its experts have num_parts parts (1..EXPCACHE_MAX_PARTS), each
 * described by parts[p]: an FP8 expert's weights and their block scales, MXFP4
 * blocks and scales, biases, each its own part. num_parts 0 is the three-part
 * shorthand: gate, up and down, described by the gate_*, up_* and down_* fields
 * (expert e's gate bytes at gate_base + e*gate_stride, gate_bytes long; likewise
 * up and down), and the same as num_parts 3 with parts {gate, up, down}. With
 * num_parts >= 1 the gate_*, up_* and down_* fields must be 0, and so must every
 * parts[p] from num_parts on. Strides must be at least the part's size.
 * The expert's size class is its exact part sizes, in order: layers whose parts
 * differ in number or in any size are classes apart (a model mixing FP8 and bf16
 * layers, or q2 and q4 ones, never thrashes).
 * With EXPCACHE_SOURCE_FILE the bases hold byte offsets into the file `file`
 * (cast to pointers; 0 is a valid offset) and every expert must lie inside the
 * file.
 */
typedef struct expcache_layer_desc_t {
    uint32_t struct_size; /**< sizeof(expcache_layer_desc_t) */
    uint32_t num_experts; /**< 1..EXPCACHE_MAX_EXPERTS_LIMIT */
    uint32_t source_kind; /**< EXPCACHE_SOURCE_* */
    uint32_t file;        /**< EXPCACHE_SOURCE_FILE: the id from expcache_file_open; else must be 0 */
    uint64_t gate_bytes, up_bytes, down_bytes;    /**< num_parts 0: each 1..EXPCACHE_MAX_PART_BYTES_LIMIT */
    uint64_t gate_stride, up_stride, down_stride; /**< num_parts 0: bytes between experts */
    const void* gate_base;
    const void* up_base;
    const void* down_base;
    uint32_t num_parts;                        /**< 0: gate, up, down above; 1..EXPCACHE_MAX_PARTS: parts[] */
    uint32_t reserved;                         /**< must be 0 */
    expcache_part_t parts[EXPCACHE_MAX_PARTS]; /**< num_parts >= 1: parts[0..num_parts-1] */
} expcache_layer_desc_t;

/** Zero *desc and set struct_size. Fails only on NULL. */
EXPCACHE_API expcache_status_t expcache_layer_desc_init(expcache_layer_desc_t* desc);

/**
 * Open `path` read-only as a source of expert bytes and give its id for
 * expcache_layer_desc_t.file. Misses are read with pread (config.file_reads:
 * through the page cache, or with O_DIRECT where the file system allows it,
 * falling back to buffered reads where it does not), several reads in flight
 * (config.copy_threads), into the pinned staging ring. The file must not shrink while the cache
 * uses it; it is closed when the cache is destroyed. Status:
 * INVALID_ARGUMENT, INVALID_STATE (1024 files open already), IO (cannot
 * open; the message has errno's text).
 */
EXPCACHE_API expcache_status_t expcache_file_open(expcache_t* cache, const char* path, uint32_t* out_file);

/**
 * expcache_file_open for a file the caller holds open as descriptor `fd` (an engine
 * that keeps its model's descriptor, not a path). The library reads through a
 * duplicate of its own, made now, so the caller may close `fd` at once; O_DIRECT
 * reads (config.file_reads) reopen it through /proc/self/fd where the system has it,
 * else they are buffered. Status: INVALID_ARGUMENT (fd negative, not open, or not
 * open for reading), INVALID_STATE (1024 files open already), IO (not a regular file).
 */
EXPCACHE_API expcache_status_t expcache_file_open_fd(expcache_t* cache, int fd, uint32_t* out_file);

/**
 * Register layer `layer` (< config.num_layers). Each layer is registered
 * once (until expcache_layer_unregister). Validates sizes, strides, pointers
 * and address overflow. Status: INVALID_ARGUMENT, INVALID_STATE (already
 * registered; on a device-lookup cache after its first class was bound, a layer
 * not registered before, or registered again with more experts than it had).
 */
EXPCACHE_API expcache_status_t expcache_layer_register(expcache_t* cache, uint32_t layer,
                                                       const expcache_layer_desc_t* desc);

/**
 * Register n layers at once: layers[i] (< config.num_layers) described by
 * descs[i] (struct_size set in each), as n calls of expcache_layer_register, but
 * all or nothing: every descriptor is checked first and nothing is registered
 * when one fails (the message says which, "descs[i]: ..."). An engine that holds
 * its model's table of layers registers it with one call. Status: INVALID_ARGUMENT
 * (NULL arrays, n 0 or over 2^20, a struct_size, a layer listed twice, a
 * descriptor expcache_layer_register refuses), INVALID_STATE (a layer registered
 * already; a class bound on a device-lookup cache).
 */
EXPCACHE_API expcache_status_t expcache_layers_register(expcache_t* cache, uint32_t n, const uint32_t* layers,
                                                        const expcache_layer_desc_t* descs);

/**
 * Unregister layer `layer`, keeping the rest of the warm cache: its resident
 * experts leave (their slots become free for the other layers of its class;
 * every other layer's residents stay, byte for byte), and the library forgets
 * its source: once this returns nothing of the library reads the host memory
 * or file range the layer described, so the caller may free or unmap that
 * memory (a file opened with expcache_file_open stays open, the cache's, for
 * other layers). The layer may then be registered again, with other sizes or
 * another source. First its queued prefetches are cancelled and the device is
 * synchronized (the call waits for the work enqueued on every stream: kernels
 * reading its slots, copies from its source). Budget shares follow the layout
 * without it (a class's cap changes at its next growth or budget change).
 * Addresses and slots handed out for the layer are invalid afterwards, and a
 * CUDA graph that captured a select of it must not be replayed. On a
 * device-lookup cache its experts leave the device's slot map; registered
 * again after the first class was bound it may have at most the experts it
 * had (the device table is sized then), and a new size needs a class index no
 * class holds yet (a class is never reused there). Synchronous. Status:
 * INVALID_ARGUMENT (layer out of range), INVALID_STATE (layer not registered;
 * an unfinished batch of the layer, from expcache_batch_prepare_*: finish it
 * first; nothing changed), CUDA, POISONED.
 */
EXPCACHE_API expcache_status_t expcache_layer_unregister(expcache_t* cache, uint32_t layer);

/* ---------------------------------------------------------------------- */
/* Budgets of a live cache                                                 */
/* ---------------------------------------------------------------------- */

/**
 * Replace the cache's budgets (expcache_config_t's budget_experts and
 * budget_bytes, meant as there: 0 = no limit from that field, at least one
 * set) without losing the warm cache. Every class's cap is recomputed as
 * expcache_create computes caps: its target, limited by free device memory
 * (the memory of the cache's own slots counted as free) minus reserve_bytes,
 * the classes served in index order (so the last ones shrink first when
 * memory is short). A class whose new cap is below its slots: the policy's
 * victims are evicted (counted as evictions on EXPCACHE_PATH_CONTROL) until
 * the cap holds every resident left, the residents in slots past the cap move
 * into free slots below it (a device-to-device copy: their slot ids change),
 * and the bank's memory past the cap is given back in the pieces it was mapped
 * in (at most slab_bytes each: the piece the cap ends in stays mapped), its
 * base address unchanged; every other resident keeps its bytes. A class whose
 * cap grows keeps every resident and grows as misses come (a device-lookup
 * bank maps its new slots now). When a class shrinks, queued prefetches are
 * cancelled and the device is synchronized first. A cap notice is logged for
 * each class whose cap changes. Addresses and slot ids handed out before are
 * invalid afterwards. On a device-lookup cache the device's residency changes
 * the same way, the victims ranked as a device select ranks them; a CUDA
 * graph captured before keeps the cap it was captured with and never takes a
 * slot a shrink took away (those rows are pinned), so replaying it is safe,
 * but capture it again to use new slots, or when it selects more ids than the
 * new cap holds. Synchronous. Status: INVALID_ARGUMENT (both budgets 0),
 * INVALID_STATE (a class that must shrink holds slots of an unfinished batch:
 * finish it first; nothing changed), CUDA, POISONED.
 */
EXPCACHE_API expcache_status_t expcache_budget_set(expcache_t* cache, uint64_t budget_experts, uint64_t budget_bytes);

/**
 * Replace the cache's reserve_bytes (expcache_config_t's: device memory the
 * expert caches never grow into) without losing the warm cache: every class's
 * cap is recomputed, and each class shrinks or grows, as expcache_budget_set
 * says. An engine that needs memory for a longer context raises it; the
 * classes give back what the reserve now claims. EXPCACHE_RESERVE_GB is read
 * by expcache_create only: this value is the one in force. Synchronous.
 * Status: INVALID_STATE (as expcache_budget_set), CUDA, POISONED.
 */
EXPCACHE_API expcache_status_t expcache_reserve_set(expcache_t* cache, uint64_t reserve_bytes);

/**
 * The budgets in force: *out_budget_experts and *out_budget_bytes as expcache_config_t's (0 =
 * no limit from that field), budget_bytes as measured when EXPCACHE_BUDGET_FREE_MEMORY asked for
 * it; *out_free_memory (optional, may be NULL) 1 when it did. Status: INVALID_ARGUMENT (NULL).
 */
EXPCACHE_API expcache_status_t expcache_budget_get(const expcache_t* cache, uint64_t* out_budget_experts,
                                                   uint64_t* out_budget_bytes, uint32_t* out_free_memory);

/**
 * The cache's device memory now: *out_free and *out_total bytes (cudaMemGetInfo on the cache's
 * device; the host backend's emulated device). Status: INVALID_ARGUMENT (NULL), CUDA.
 */
EXPCACHE_API expcache_status_t expcache_device_memory_get(expcache_t* cache, uint64_t* out_free, uint64_t* out_total);

/* ---------------------------------------------------------------------- */
/* Serving experts                                                         */
/* ---------------------------------------------------------------------- */

/**
 * Device addresses of one expert's three parts. The calls that hand these out
 * (expcache_select_async, expcache_select_split_async, expcache_batch_prepare_async
 * and their *_ids twins) serve layers of three parts; a layer of another number of
 * parts is refused there (INVALID_STATE, naming the calls that serve it): serve it by
 * slot id (expcache_select_slots_async, expcache_select_device_async,
 * expcache_batch_prepare_slots_async) and read each part at the bank's part_offset.
 */
typedef struct expcache_expert_ptrs_t {
    void* gate;
    void* up;
    void* down;
} expcache_expert_ptrs_t;

/** Most expert ids one select call takes. */
#define EXPCACHE_MAX_SELECT 1024

/**
 * Decode path. Make experts ids[0..k) of `layer` resident and write their
 * device addresses to out_ptrs[0..k) (duplicates allowed: they get the same
 * addresses and count once). Hits refresh recency; a miss takes a free slot,
 * grows the class within its cap, or evicts the class's least recently used
 * expert that is neither selected by this call nor held by an unfinished
 * batch. When the class cannot hold the whole request, the rest is staged
 * in the staging rows of the class's bank (expcache_class_bank_get), mapped as
 * calls need them. Copies are enqueued on `stream`.
 *
 * The addresses are valid for device work enqueued on `stream` (or ordered
 * after it) before the next select_async, compact_load_async,
 * batch_prepare_async, release_all or layer_bind_class call on this cache.
 * A later call on another stream waits, on the device, for the work
 * enqueued on this stream before it overwrites a slot.
 * On a device-lookup cache the call runs the device select on `stream` and
 * synchronizes it (see "Serving from the device").
 * Status: INVALID_ARGUMENT, INVALID_STATE, OUT_OF_DEVICE_MEMORY, IO (file
 * sources), CUDA, POISONED.
 */
EXPCACHE_API expcache_status_t expcache_select_async(expcache_t* cache, uint32_t layer, const uint32_t* ids, uint32_t k,
                                                     void* stream, expcache_expert_ptrs_t* out_ptrs);

/**
 * expcache_select_async with ids[0..k) host integers of `id_bits` 32 or 64 bits (a
 * router's int32 or int64 output as it is). Status: INVALID_ARGUMENT (id_bits, an
 * id negative or over 32 bits), then as expcache_select_async.
 */
EXPCACHE_API expcache_status_t expcache_select_ids_async(expcache_t* cache, uint32_t layer, const void* ids,
                                                         uint32_t id_bits, uint32_t k, void* stream,
                                                         expcache_expert_ptrs_t* out_ptrs);

/**
 * Decode path by slot id: expcache_select_async, except that ids (host memory) are
 * integers of `id_bits` 32 or 64 bits (a router's int32 or int64 output as it is)
 * and out_slots[i] (host memory) is ids[i]'s row in its class's bank
 * (expcache_class_bank_get): its parts are at base + slot*slot_stride + the part's
 * offset, so a kernel reads every selected expert by one base and stride, with no
 * table of addresses and no gather. The misses are copied into their slots on
 * `stream`. Experts that get no slot (the class cannot hold the whole request) are
 * staged in the bank's staging rows, addressed the same way. The slots are valid as
 * expcache_select_async's addresses are. Status: INVALID_ARGUMENT (k 0 or over
 * EXPCACHE_MAX_SELECT, an id out of range, negative or over 32 bits, id_bits not 32
 * or 64, NULL pointers), then as expcache_select_async.
 */
EXPCACHE_API expcache_status_t expcache_select_slots_async(expcache_t* cache, uint32_t layer, const void* ids,
                                                           uint32_t id_bits, uint32_t k, int32_t* out_slots,
                                                           void* stream);

/**
 * Hits before misses: expcache_select_async, except that the misses are copied on
 * the cache's own copy stream, so the hits can be used at once. out_resident[i] is 1
 * when ids[i] was resident when the call began: its addresses are valid for work
 * enqueued on `stream` from now on, exactly as expcache_select_async's. The others'
 * bytes land on the copy stream; *out_ready is an event (a cudaEvent_t) recorded
 * behind them, which work on `stream` must wait for (cudaStreamWaitEvent, or
 * expcache_ready_wait_async) before it reads them. *out_ready is NULL when
 * nothing needs waiting for: no misses, or the host backend (whose copies finish
 * before the call returns). The event belongs to the cache and is recorded again
 * by the next call of this function; a wait enqueued before that stays valid.
 * The copy stream waits for the work enqueued on `stream` before this call, so no
 * slot a kernel may still read is overwritten; later calls on any stream wait for
 * the copy stream, so a caller that never waits for *out_ready still never reads
 * a torn slot after its next call. Status: as expcache_select_async, and
 * UNSUPPORTED on a device-lookup cache (its select copies the misses in its own
 * grid: use expcache_select_async).
 */
EXPCACHE_API expcache_status_t expcache_select_split_async(expcache_t* cache, uint32_t layer, const uint32_t* ids,
                                                           uint32_t k, void* stream, expcache_expert_ptrs_t* out_ptrs,
                                                           uint8_t* out_resident, void** out_ready);

/**
 * expcache_select_split_async with
 * ids of `id_bits` 32 or 64 bits (a router's int32 or int64 output as it is; ds4's
 * are int32). Status: INVALID_ARGUMENT (id_bits; the count first, as the call checks it; an id
 * negative or over 32 bits), then as expcache_select_split_async.
 */
EXPCACHE_API expcache_status_t expcache_select_split_ids_async(expcache_t* cache, uint32_t layer, const void* ids,
                                                               uint32_t id_bits, uint32_t k, void* stream,
                                                               expcache_expert_ptrs_t* out_ptrs, uint8_t* out_resident,
                                                               void** out_ready);

/**
 * Make `stream` wait (on the device) for `ready`, an event from
 * expcache_select_split_async; NULL returns at once (the host backend always
 * gives NULL). Status: INVALID_ARGUMENT (ready is not this cache's event), CUDA.
 */
EXPCACHE_API expcache_status_t expcache_ready_wait_async(expcache_t* cache, void* ready, void* stream);

/**
 * Prefetch: copy experts ids[0..n) of `layer`, expected to be selected soon, into
 * the cache using the link's idle time. Returns at once; the bytes move on the
 * cache's copy stream, at most config.prefetch_piece_bytes in flight at a time
 * (two transfers of half), from a thread of the cache's (the first from the
 * calling thread when the source is pinned). Every serving call (select, compact
 * load, batch) first takes back what is still queued: the experts a select or
 * batch lists are finished by it in place (the rest of their bytes into the same
 * slot, on its stream: a miss, counted late, never used), the others are cancelled and
 * their slots freed. A demand miss therefore shares the link with at most one
 * piece in flight, and its stream waits for the copy stream only when it reads
 * or rewrites a slot a prefetch sent bytes into. Ids earlier in the list are sent
 * first (list them most likely first). An id already resident or on its way is
 * skipped; at most config.prefetch_max_per_layer experts of a layer are
 * prefetched between two serving calls of it, and a prefetch only takes a free slot, grows the
 * class within its cap, or evicts an expert that neither the current nor the
 * previous serving call used and that no batch holds (never one of this call's).
 * Prefetched experts enter the policy as the first to go until a select uses
 * them. Bytes land after the work enqueued on `stream` before the previous serving
 * call (before the first serving call: on `stream` so far), so kernels still reading
 * older experts are never overwritten. *out_queued (may be NULL): experts queued.
 * Counted in expcache_prefetch_stats_get. Status: INVALID_ARGUMENT, INVALID_STATE
 * (layer not registered), OUT_OF_DEVICE_MEMORY, CUDA (also a failure of an earlier
 * prefetch piece, reported once), POISONED.
 */
EXPCACHE_API expcache_status_t expcache_prefetch_async(expcache_t* cache, uint32_t layer, const uint32_t* ids,
                                                       uint32_t n, void* stream, uint32_t* out_queued);

/**
 * expcache_prefetch_async with
 * ids of `id_bits` 32 or 64 bits (a router's int32 or int64 output as it is; ds4's
 * are int32). Status: INVALID_ARGUMENT (id_bits; the count first, as the call checks it; an id
 * negative or over 32 bits), then as expcache_prefetch_async.
 */
EXPCACHE_API expcache_status_t expcache_prefetch_ids_async(expcache_t* cache, uint32_t layer, const void* ids,
                                                           uint32_t id_bits, uint32_t n, void* stream,
                                                           uint32_t* out_queued);

/**
 * Wait, on the host, until every prefetch queued by expcache_prefetch_async has
 * been sent and has landed (the cache's copy stream synchronized). Each expert
 * queued is then resident: a serving call that lists it before it is evicted is a
 * hit and counts it used. Returns at once when nothing is queued. Synchronous;
 * other calls on this cache wait until it returns. A piece that failed is reported
 * here once (CUDA, as expcache_prefetch_async would): its expert is not resident,
 * counted cancelled. While the prefetch thread is paused
 * (expcache_testing_prefetch_pause) with prefetches queued, it waits only for the
 * pieces in flight and fails with INVALID_STATE, the queue left as it was.
 * Status: INVALID_ARGUMENT, INVALID_STATE (paused), CUDA, POISONED.
 */
EXPCACHE_API expcache_status_t expcache_prefetch_wait(expcache_t* cache);

/**
 * Hint: experts ids[0..n) of `layer` are expected to be selected soon. Those
 * resident are refreshed in the policy as a select's hits would be (no copy, no
 * counters of the decode path); the rest are ignored. Counted in
 * expcache_prefetch_stats_get. Status: INVALID_ARGUMENT, INVALID_STATE.
 */
EXPCACHE_API expcache_status_t expcache_hint(expcache_t* cache, uint32_t layer, const uint32_t* ids, uint32_t n);

/**
 * expcache_hint with
 * ids of `id_bits` 32 or 64 bits (a router's int32 or int64 output as it is; ds4's
 * are int32). Status: INVALID_ARGUMENT (id_bits; the count first, as the call checks it; an id
 * negative or over 32 bits), then as expcache_hint.
 */
EXPCACHE_API expcache_status_t expcache_hint_ids(expcache_t* cache, uint32_t layer, const void* ids, uint32_t id_bits,
                                                 uint32_t n);

/**
 * Seed the cache: experts ids[0..n) of `layer` (host integers of `id_bits` 32 or
 * 64 bits) are made resident now, copied on `stream`, as an engine loads a hot
 * list before serving. Each id is taken once, at its highest priority
 * (priorities[i]; NULL: the given order, the last highest), and they go in lowest
 * priority first, each taking the policy's victim when its class is full, so what
 * stays is the highest priorities the class can hold, the highest the most
 * recently used (the policy counts their uses as a select's). Counted on
 * EXPCACHE_PATH_CONTROL, so the decode counters stay the decode's. Works on every
 * cache (a device-lookup cache runs its device select for each). Status: INVALID_ARGUMENT
 * (NULL ids, id_bits, n 0 or over 2^20, an id out of range, a NaN priority:
 * nothing is inserted), INVALID_STATE (layer not registered), then as
 * expcache_select_async.
 */
EXPCACHE_API expcache_status_t expcache_insert_async(expcache_t* cache, uint32_t layer, const void* ids,
                                                     uint32_t id_bits, const float* priorities, uint32_t n,
                                                     void* stream);

/**
 * A compact buffer: one region per part, in part order (all gate parts, then all
 * up parts, then all down parts, for three). The gate_*, up_* and down_* fields
 * are parts 0, 1 and 2 when the layer has three parts, else 0.
 */
typedef struct expcache_compact_t {
    uint32_t struct_size;                         /**< sizeof(expcache_compact_t); set by the caller */
    uint32_t num_experts;                         /**< experts in the buffer (= n, duplicates included) */
    void* base;                                   /**< start of the buffer */
    uint64_t bytes;                               /**< bytes used from base */
    uint64_t gate_offset, up_offset, down_offset; /**< region starts, from base */
    uint64_t gate_bytes, up_bytes, down_bytes;    /**< per-expert part sizes (region strides) */
    uint32_t num_parts;                           /**< the layer's parts */
    uint32_t reserved;
    uint64_t part_offset[EXPCACHE_MAX_PARTS]; /**< region p starts at base + part_offset[p] (256-byte aligned) */
    uint64_t part_bytes[EXPCACHE_MAX_PARTS];  /**< per-expert size of part p (region p's stride) */
} expcache_compact_t;

/**
 * Copy experts ids[0..n) of `layer` into one contiguous device buffer:
 * expert i's part p at base + part_offset[p] + i*part_bytes[p] (for three
 * parts: gate at base + gate_offset + i*gate_bytes, likewise up and down; the
 * [experts][bytes] layout batched kernels read). Hits are copied
 * device to device from the cache (and refresh recency), misses host to
 * device; residency does not change. The staging allocation is tried
 * first; only if it fails are the expert caches released and the
 * allocation retried, once. The buffer is owned by the cache and valid for
 * work enqueued on `stream` before the next compact_load_async call or
 * release_all. Status: INVALID_ARGUMENT, INVALID_STATE,
 * OUT_OF_DEVICE_MEMORY (after the retry), IO (file sources), CUDA, POISONED.
 */
EXPCACHE_API expcache_status_t expcache_compact_load_async(expcache_t* cache, uint32_t layer, const uint32_t* ids,
                                                           uint32_t n, void* stream, expcache_compact_t* out);

/**
 * expcache_compact_load_async with
 * ids of `id_bits` 32 or 64 bits (a router's int32 or int64 output as it is; ds4's
 * are int32). Status: INVALID_ARGUMENT (id_bits; the count first, as the call checks it; an id
 * negative or over 32 bits), then as expcache_compact_load_async.
 */
EXPCACHE_API expcache_status_t expcache_compact_load_ids_async(expcache_t* cache, uint32_t layer, const void* ids,
                                                               uint32_t id_bits, uint32_t n, void* stream,
                                                               expcache_compact_t* out);

/** Most batches outstanding at once on one cache. */
#define EXPCACHE_MAX_BATCHES 64
/** A class's batch rows: what its open batches by slot id may stage at once. */
#define EXPCACHE_MAX_BATCH_ROWS 4096

/**
 * Prefill path. Serve the union of ids[0..n) (many tokens' selections of
 * one layer): resident experts are read in place, misses are appended
 * into free capacity of the class (inserted as least recently used, so
 * they are the first to go), and the rest are loaded into a staging buffer
 * owned by the batch. A batch never evicts and its staging never releases
 * the caches (it comes out of the reserve), so the decode working set
 * survives a prompt of any length; when that staging does not fit, the call
 * fails with OUT_OF_DEVICE_MEMORY and the cache is unchanged but for
 * appended experts. Writes the unique ids in first-appearance
 * order to out_ids[0..*out_count) and their addresses to out_ptrs (both
 * arrays of at least n entries), and a batch handle to *out_batch. Every
 * cache slot the batch uses is held — never evicted — until
 * expcache_batch_finish(). Status: INVALID_ARGUMENT, INVALID_STATE
 * (EXPCACHE_MAX_BATCHES outstanding), OUT_OF_DEVICE_MEMORY, IO (file sources),
 * CUDA, POISONED.
 */
EXPCACHE_API expcache_status_t expcache_batch_prepare_async(expcache_t* cache, uint32_t layer, const uint32_t* ids,
                                                            uint64_t n, void* stream, uint32_t* out_ids,
                                                            expcache_expert_ptrs_t* out_ptrs, uint32_t* out_count,
                                                            uint64_t* out_batch);

/**
 * expcache_batch_prepare_async with
 * ids of `id_bits` 32 or 64 bits (a router's int32 or int64 output as it is; ds4's
 * are int32). Status: INVALID_ARGUMENT (id_bits; the count first, as the call checks it; an id
 * negative or over 32 bits), then as expcache_batch_prepare_async.
 */
EXPCACHE_API expcache_status_t expcache_batch_prepare_ids_async(expcache_t* cache, uint32_t layer, const void* ids,
                                                                uint32_t id_bits, uint64_t n, void* stream,
                                                                uint32_t* out_ids, expcache_expert_ptrs_t* out_ptrs,
                                                                uint32_t* out_count, uint64_t* out_batch);

/**
 * Prefill path by slot id: expcache_batch_prepare_async's batch (the same union,
 * holds, appends and counters), its ids[0..n) host integers of `id_bits` 32 or 64
 * bits, and, instead of addresses, out_slots[j] the row of out_ids[j] in its
 * class's bank (expcache_class_bank_get): a hit's or an appended miss's slot
 * (below cap), or, for an expert staged for want of free capacity, one of the
 * bank's batch rows (at or past cap, below rows), so a kernel reads every expert
 * of the batch by base + slot * slot_stride with no gather. The batch rows
 * (EXPCACHE_MAX_BATCH_ROWS per class) are mapped as batches need them, out of the reserve as batch staging
 * is, and stay mapped until the class is released (class_info's staging_bytes
 * counts them); a batch's rows stay its own until it finishes, and the rows are
 * taken again from the first once no batch of the class holds any. Status: as
 * expcache_batch_prepare_async, and INVALID_ARGUMENT (id_bits, an id negative or
 * over 32 bits), INVALID_STATE (the open batches have taken the class's batch rows:
 * finish some first).
 */
EXPCACHE_API expcache_status_t expcache_batch_prepare_slots_async(expcache_t* cache, uint32_t layer, const void* ids,
                                                                  uint32_t id_bits, uint64_t n, void* stream,
                                                                  uint32_t* out_ids, int32_t* out_slots,
                                                                  uint32_t* out_count, uint64_t* out_batch);

/**
 * End a batch: its held slots become evictable and its staging buffer is
 * freed once the work enqueued on `stream` so far has finished. The
 * batch's addresses are invalid afterwards. Status: INVALID_ARGUMENT (unknown
 * or finished batch), CUDA, POISONED.
 */
EXPCACHE_API expcache_status_t expcache_batch_finish(expcache_t* cache, uint64_t batch, void* stream);

/**
 * Release every expert cache: waits for this cache's device work, frees all
 * slots and staging rows of classes that hold no batch slot and the compact
 * buffer (so every address select_async and compact_load_async handed out). A class's bank keeps its addresses (the
 * next growth maps them again); its memory is given back unless references keep the bank (expcache_memory_retain),
 * which keep it mapped and only emptied, as is a device-lookup cache's. The layout and the statistics remain.
 * Synchronous. Status: INVALID_ARGUMENT, CUDA, POISONED.
 */
EXPCACHE_API expcache_status_t expcache_release_all(expcache_t* cache);

/**
 * Wait, on the host, until the device work this cache enqueued on `stream`
 * has finished (the host backend returns at once). Status: INVALID_ARGUMENT,
 * CUDA, POISONED.
 */
EXPCACHE_API expcache_status_t expcache_synchronize(expcache_t* cache, void* stream);

/* ---------------------------------------------------------------------- */
/* Serving from the device (config.lookup = EXPCACHE_LOOKUP_DEVICE)        */
/* ---------------------------------------------------------------------- */

/*
 * On a device-lookup cache each size class keeps its slots in one bank: one
 * range of device addresses at a fixed stride, `cap` slots of it mapped whole when
 * the class is bound (expcache_layer_bind_class, or the first serving call of one of
 * its layers) and kept, at the same address, until the cache is destroyed
 * (expcache_budget_set and expcache_reserve_set may change how many). Beside
 * the banks the cache keeps its residency on the device, in one copy: which slot
 * holds which expert, the slots batches pin, the policy's state, the counters of
 * EXPCACHE_PATH_DEVICE and each class's resident count.
 *
 * Every policy runs in the device lookup: LRU, OppClassLRU and DUEL (the default),
 * each choosing its victims as the host select does (the same rules, one source),
 * so a device select's hits equal the host select's for the same calls. The
 * policy's state: the slots' recency (LRU), and under OPPCLASS and DUEL each
 * expert's use count, the slots' lists and duel's shadow caches and counter.
 *
 * expcache_select_device_async reads and updates that state with kernels on its
 * stream alone, so it may be captured in a CUDA graph and replayed. The host-side
 * serving calls run the same kernel on that state, each in its path's mode, on the
 * call's stream, which they synchronize to read the slots back: select and
 * select_slots as a decode select (an expert that gets no slot is staged in the
 * bank's staging rows), compact_load lending the hits (refreshed, nothing
 * inserted), batch_prepare appending into free slots only (pinned until
 * batch_finish, which unpins them on its stream). From a source the GPU cannot
 * read (pageable, file) the kernel chooses the slots and the call copies into
 * them. class_info, stats and expcache_stats_read synchronize the device and read
 * every class's counters and residents with one copy; release_all synchronizes
 * it and clears each released class with a kernel; read_resident reads one slot of
 * the slot map. They must
 * not run while device selects are in flight on other threads' streams. On a
 * device-lookup cache:
 *   - every layer is registered before the first class is bound (the banks and the
 *     device table are sized from the whole layout); a layer unregistered may be
 *     registered again with at most the experts it had;
 *   - a class index is never reused for other sizes (max_classes must cover them);
 *   - release_all empties the banks but keeps their memory (captured graphs read
 *     them), and a staging allocation that fails is retried after emptying them;
 *   - prefetch_async and hint are refused (UNSUPPORTED): a device select copies
 *     its misses itself; select_split is refused (UNSUPPORTED): the select copies
 *     its misses inside its own grid, so there is nothing to overlap;
 *   - release_all empties the banks and keeps what the policy learned (counts,
 *     duel's shadows and counter), as on a host-lookup cache;
 *   - the partition is GLOBAL.
 */

/**
 * One class's bank: slot s's part p is at
 *
 *     base + part_offset[p] + s * part_stride[p]
 *
 * part_bytes[p] long, for both arrangements (for three parts also gate_offset and
 * gate_bytes, likewise up and down; those fields are 0 when the class's experts
 * have another number of parts). Every slot id a call of this cache gives for the
 * class's layers (expcache_select_slots_async, expcache_select_device_async,
 * expcache_batch_prepare_slots_async) is in 0..rows-1, and base never changes
 * while the class lives.
 *
 * EXPCACHE_BANK_SLOTS (the default): every part of an expert lies in its slot, a
 * row of slot_stride bytes; part_offset[p] is the part's start within the slot and
 * every part_stride[p] is slot_stride. EXPCACHE_BANK_PARTS: a region per part, each
 * of rows * part_stride[p] bytes starting at part_offset[p] (on the memory
 * granularity), part_stride[p] the part's bytes rounded up to 256: a part whose
 * bytes are a multiple of 256 is one contiguous [rows, part] array, and gate and
 * up are never adjacent (a fused gate-and-up view needs SLOTS); slot_stride is 0
 * (no slot is one range). Mapping rows (as the class grows, staging) maps them in
 * every region.
 */
typedef struct expcache_bank_t {
    uint32_t struct_size;                         /**< sizeof(expcache_bank_t); set by the caller */
    uint32_t num_parts;                           /**< parts per expert (1..EXPCACHE_MAX_PARTS) */
    void* base;                                   /**< device address of slot 0 (256-byte aligned) */
    uint64_t slot_stride;                         /**< SLOTS: bytes between slots; PARTS: 0 (use part_stride) */
    uint64_t cap;                                 /**< slots mapped now (a device-lookup bank: all of its slots) */
    uint64_t gate_offset, up_offset, down_offset; /**< three parts: part_offset[0..2] */
    uint64_t gate_bytes, up_bytes, down_bytes;    /**< three parts: part sizes */
    uint64_t rows;                                /**< rows slot ids address: 0..rows-1 */
    uint64_t part_offset[EXPCACHE_MAX_PARTS];     /**< SLOTS: part starts within a slot (256-byte aligned); PARTS:
                                                       the part's region's start */
    uint64_t part_bytes[EXPCACHE_MAX_PARTS];      /**< part sizes: the class key (0 past num_parts) */
    uint32_t arrangement;                         /**< EXPCACHE_BANK_SLOTS or _PARTS (the cache's config) */
    uint32_t reserved;                            /**< 0 */
    uint64_t part_stride[EXPCACHE_MAX_PARTS];     /**< bytes from slot s's part p to slot s+1's (SLOTS: slot_stride;
                                                       PARTS: the part's bytes rounded up to 256, 0 past num_parts) */
} expcache_bank_t;

/**
 * Fill *out (struct_size set by the caller) with the bank of class `class_index`
 * (from expcache_layer_bind_class), on any cache. A class's bank is one range of
 * addresses (its slots at fixed strides, in the cache's bank_arrangement), reserved when
 * the class is bound and kept at the same address while the class lives (a host-lookup cache reserves a new one only
 * when it reuses the class index for other sizes, when there are more than max_classes). A device-lookup bank maps all
 * its slots when bound and keeps them until the cache is destroyed or a budget change resizes it. A host-lookup bank
 * maps its slots as the class grows (cap, up to the class's cap in expcache_class_info_get) and gives their memory back
 * when the class is released, unless references (expcache_memory_retain: views of it) keep it, which keep it mapped.
 * Past the slots, every bank has 1024 staging rows, the experts a decode select stages when they get no slot, then
 * EXPCACHE_MAX_BATCH_ROWS batch rows, those batches by slot id stage (both mapped
 * when calls need them, and kept until the class is released; each range starts
 * past the memory granule the one before ends in). Status: INVALID_ARGUMENT (index
 * out of range, struct_size mismatch), INVALID_STATE (no class at that index).
 */
EXPCACHE_API expcache_status_t expcache_class_bank_get(expcache_t* cache, uint32_t class_index, expcache_bank_t* out);

/**
 * Device-side select: the n rows of k expert ids of `layer` at `ids` (device
 * memory; host memory on the host backend), integers of `id_bits` 32 or 64 bits,
 * become resident in the layer's bank, and out_slots[i] (device memory, n*k int32)
 * is ids[i]'s slot in it. The rows are one step (several tokens of a speculative
 * verification): each distinct expert is copied once and none of them is evicted by
 * another. One kernel on `stream` looks the ids up, counts and refreshes them by
 * the cache's policy, evicts the policy's victims among the slots not used by this
 * call and not held by a batch (the host select's choices), copies the misses'
 * bytes from the layer's source, and counts; when every id is resident it only
 * reads the slot map and does the policy's hit bookkeeping (no victim search, no
 * copy; docs/device_lookup.md). No host synchronization and no host decision
 * depends on the ids: the call may be made while `stream` is being captured into a
 * CUDA graph, and each replay does the whole select. On compute capability 9.0 and
 * later the kernel is a programmatic dependent launch: it is scheduled while the kernel
 * ahead of it on `stream` (the router's) drains, and reads nothing before that one has
 * finished and its writes are visible, so the ordering is a normal launch's; under
 * capture the graph keeps it as a programmatic edge. An id out of range gets slot
 * -1; the next call that reads the device's counters (class_info, stats) logs the
 * first such id as a warning (layer, id, index), once; expcache_destroy logs one
 * no call read.
 *
 * The slots stay valid for work ordered after this call on `stream` until the next
 * call that serves or releases on this cache. Work on other streams is ordered by the
 * caller (events), as for any device buffer. The first call for a layer binds its
 * class (allocating its bank), which a capture does not allow: bind before capturing
 * (expcache_layer_bind_class, or one call outside the capture).
 *
 * Sources. The GPU reads a pinned source itself (mapped). A pageable or file source
 * is fed: the kernel lists each miss in mapped pinned memory as it picks its slot,
 * the cache's feed threads (started with the first class that needs them: one that
 * polls, spinning while selects come and sleeping 50 us between polls after 2 ms
 * without one, and config.copy_threads that read) read it in pieces of 256 KiB or
 * more, all at once, into one of 8 pinned rows of the class (O_DIRECT where the
 * file was opened so), and the kernel copies each piece into the slot as it is
 * ready. No host call sits between them, so a fed select is captured and replayed
 * as one node like any other. A read that fails is logged (a warning, with the
 * reason) by the thread that read it; the select still ends, gives that expert's
 * ids slot -1 (as an id out of range: no bytes that never came are served) and
 * frees its slot, so the next select reads it again. A kernel waits at most 60 s
 * for a piece, then treats its read as failed. With a host pool
 * (config.host_budget_bytes) each miss is read through it: a pool hit is copied
 * from its RAM into the row, the source not read (expcache_pool_stats_t).
 * docs/device_lookup.md has the protocol.
 *
 * Status: INVALID_ARGUMENT (n*k 0 or over EXPCACHE_MAX_SELECT, or over the bank's
 * cap less the slots batches hold; id_bits; NULL pointers), INVALID_STATE (not a
 * device-lookup cache, layer not registered, a capture under way when the class must
 * be bound), UNSUPPORTED (a pinned source the GPU cannot map), OUT_OF_HOST_MEMORY
 * (the class's feed could not be made when it was bound), CUDA, POISONED.
 */
EXPCACHE_API expcache_status_t expcache_select_device_async(expcache_t* cache, uint32_t layer, const void* ids,
                                                            uint32_t id_bits, uint32_t n, uint32_t k,
                                                            int32_t* out_slots, void* stream);

/**
 * expcache_select_device_async that also counts the step: out_counts[0] is the
 * number of distinct experts among the n*k ids (the union of the rows), and
 * out_counts[1] how many of them missed (were copied by this call); the hits are
 * the difference. An id out of range (slot -1) is not an expert and is not
 * counted. out_counts (2 uint32; device memory, host memory on the host backend,
 * like out_slots) is written by the select's kernel on `stream`, with no host
 * synchronization (capturable, like the select), and is valid for work ordered
 * after this call on `stream`: an engine verifying a speculative draft reads it
 * on the device to price the next draft's length. Everything else is
 * expcache_select_device_async's. Status: INVALID_ARGUMENT (n*k 0 or over
 * EXPCACHE_MAX_SELECT, or over the bank's cap less the slots batches hold;
 * id_bits; NULL ids, out_slots or out_counts), INVALID_STATE (not a
 * device-lookup cache, layer not registered, a capture under way when the class
 * must be bound), UNSUPPORTED (a pinned source the GPU cannot map), CUDA, POISONED.
 */
EXPCACHE_API expcache_status_t expcache_select_device_counted_async(expcache_t* cache, uint32_t layer, const void* ids,
                                                                    uint32_t id_bits, uint32_t n, uint32_t k,
                                                                    int32_t* out_slots, uint32_t* out_counts,
                                                                    void* stream);

/* ---------------------------------------------------------------------- */
/* Size classes                                                            */
/* ---------------------------------------------------------------------- */

/**
 * Write the number of classes currently in use to *out_count (each has an
 * index 0..max_classes-1; an index may be empty). Status: INVALID_ARGUMENT.
 */
EXPCACHE_API expcache_status_t expcache_class_count_get(const expcache_t* cache, uint32_t* out_count);

/** One class slot. `in_use` is 0 for an empty slot index. */
typedef struct expcache_class_info_t {
    uint32_t struct_size;                      /**< sizeof(expcache_class_info_t); set by the caller */
    uint32_t in_use;                           /**< 1 when the index holds a class */
    uint64_t gate_bytes, up_bytes, down_bytes; /**< three parts: the class key (else 0; see part_bytes) */
    uint64_t slot_bytes;                       /**< device bytes per slot (parts 256-byte aligned) */
    uint64_t target_experts;                   /**< capacity the budgets ask for */
    uint64_t cap_experts;                      /**< runtime cap (target limited by memory) */
    uint64_t allocated_experts;                /**< slots allocated */
    uint64_t resident_experts;                 /**< slots holding an expert */
    uint64_t held_experts;                     /**< slots held by unfinished batches */
    uint64_t num_layers;                       /**< registered layers bound to this class */
    uint64_t staging_bytes; /**< device bytes mapped for the bank's staging rows (decode selects' misses
                                 that got no slot; given back when the class is released) */
    uint32_t num_parts;     /**< parts per expert (0 for an empty index) */
    uint32_t reserved;
    uint64_t part_bytes[EXPCACHE_MAX_PARTS]; /**< the class key: each part's size (0 past num_parts) */
} expcache_class_info_t;

/**
 * Fill *out (struct_size set by the caller) with class index `class_index`
 * (< config.max_classes), in use or not. Status: INVALID_ARGUMENT (index out
 * of range, struct_size mismatch).
 */
EXPCACHE_API expcache_status_t expcache_class_info_get(const expcache_t* cache, uint32_t class_index,
                                                       expcache_class_info_t* out);

/**
 * Bind layer `layer` to its size class now if it is not bound yet, as its
 * next select would, and write the class index to *out_class. Binding may
 * release the least recently used class when max_classes classes are in
 * use (its slots are freed and its index reused), so, like a select, this
 * call may invalidate the addresses handed out before it; a layer already
 * bound changes nothing. Synchronous. Status: INVALID_ARGUMENT (layer out of
 * range), INVALID_STATE (layer not registered, or every class holds slots of
 * an unfinished batch), CUDA, POISONED.
 */
EXPCACHE_API expcache_status_t expcache_layer_bind_class(expcache_t* cache, uint32_t layer, uint32_t* out_class);

/**
 * The class that holds experts of these part sizes now, in *out_class: what an
 * engine that knows its experts' sizes (its quantization) asks to read that class's
 * cap and counters with expcache_class_info_get and expcache_stats_get, or its bank.
 * Status: INVALID_ARGUMENT (no registered layer has those sizes; NULL out_class),
 * INVALID_STATE (a layer has them, but no class holds them now: bind it first; the
 * message names the layer).
 */
EXPCACHE_API expcache_status_t expcache_class_find(const expcache_t* cache, uint64_t gate_bytes, uint64_t up_bytes,
                                                   uint64_t down_bytes, uint32_t* out_class);

/**
 * expcache_class_find for experts of num_parts parts (1..EXPCACHE_MAX_PARTS) of
 * sizes part_bytes[0..num_parts-1]. Status: INVALID_ARGUMENT (num_parts, NULL
 * part_bytes or out_class, no registered layer has those sizes), INVALID_STATE
 * (as expcache_class_find).
 */
EXPCACHE_API expcache_status_t expcache_class_find_parts(const expcache_t* cache, uint32_t num_parts,
                                                         const uint64_t* part_bytes, uint32_t* out_class);

/* ---------------------------------------------------------------------- */
/* Statistics                                                              */
/* ---------------------------------------------------------------------- */

/* The constants' comments span lines, which clang-format would turn into macro continuations. */
/* clang-format off */
#define EXPCACHE_PATH_DECODE 0  /**< expcache_select_async */
#define EXPCACHE_PATH_COMPACT 1 /**< expcache_compact_load_async */
#define EXPCACHE_PATH_BATCH 2   /**< expcache_batch_prepare_async */
#define EXPCACHE_PATH_CONTROL 3 /**< expcache_release_all and other explicit calls */
#define EXPCACHE_PATH_DEVICE 4  /**< expcache_select_device_async (counted on the device, read by the
                                     synchronizing calls) */
#define EXPCACHE_NUM_PATHS 5
/* clang-format on */

/**
 * The name of serving path `path` (EXPCACHE_PATH_*): "decode", "compact", the lower-case tail
 * of its constant, as pyexpcache's stats name it and the library's log lines say it. Static;
 * NULL for `path` >= EXPCACHE_NUM_PATHS. Never fails (no status), touches no cache, callable
 * from any thread.
 */
EXPCACHE_API const char* expcache_path_name(uint32_t path);

/** Counters of one (class, path). Unique experts per call are counted once. */
typedef struct expcache_stats_t {
    uint32_t struct_size; /**< sizeof(expcache_stats_t); set by the caller */
    uint32_t reserved;
    uint64_t calls;         /**< calls that touched this class */
    uint64_t hits;          /**< experts found resident */
    uint64_t misses;        /**< experts not resident */
    uint64_t evictions;     /**< resident experts evicted to make room */
    uint64_t appends;       /**< misses inserted without eviction */
    uint64_t direct_loads;  /**< misses served from staging, not cached */
    uint64_t bytes_h2d;     /**< bytes copied host to device */
    uint64_t bytes_d2d;     /**< bytes copied device to device */
    uint64_t releases;      /**< times the class's slots were released */
    uint64_t alloc_retries; /**< staging allocations retried after a release */
    uint64_t cap_notices;   /**< runtime cap changes announced */
    uint64_t class_reuses;  /**< times this class index was taken by another key */
} expcache_stats_t;

/**
 * Copy the counters of class `class_index` (< config.max_classes) on path
 * `path` (EXPCACHE_PATH_*) to *out (struct_size set by the caller). On a
 * device-lookup cache, EXPCACHE_PATH_DEVICE's are read from the device (it is
 * synchronized: one copy); expcache_stats_read reads every class at once.
 * Status: INVALID_ARGUMENT (index or path out of range, struct_size mismatch),
 * CUDA, POISONED.
 */
EXPCACHE_API expcache_status_t expcache_stats_get(const expcache_t* cache, uint32_t class_index, uint32_t path,
                                                  expcache_stats_t* out);

/**
 * Every class's info and counters at once: infos[c] as expcache_class_info_get(c)
 * and stats[c * EXPCACHE_NUM_PATHS + p] as expcache_stats_get(c, p), for c <
 * `num_classes` (1..config.max_classes). infos[0].struct_size and
 * stats[0].struct_size, set by the caller, give the arrays' element size. On a
 * device-lookup cache the device is synchronized once and its counters and
 * residents read with one copy. Status: INVALID_ARGUMENT (NULL arrays,
 * num_classes out of range, struct_size mismatch), CUDA, POISONED.
 */
EXPCACHE_API expcache_status_t expcache_stats_read(const expcache_t* cache, uint32_t num_classes,
                                                   expcache_class_info_t* infos, expcache_stats_t* stats);

/**
 * Counters of the staging ring that moves misses of pageable and file sources
 * (zero when none was staged): where a staged call's time goes. Times are
 * nanoseconds of the host's steady clock.
 */
typedef struct expcache_staging_stats_t {
    uint32_t struct_size; /**< sizeof(expcache_staging_stats_t); set by the caller */
    uint32_t reserved;
    uint64_t calls;         /**< calls that staged something */
    uint64_t pieces;        /**< pieces staged and sent (one fill, one transfer each) */
    uint64_t bytes;         /**< bytes of those pieces */
    uint64_t caller_fills;  /**< pieces the calling thread filled itself (no worker had taken them) */
    uint64_t fill_ns;       /**< time spent filling pieces (memcpy or pread), summed over threads */
    uint64_t chunk_waits;   /**< fills that first waited for the chunk's previous transfer */
    uint64_t chunk_wait_ns; /**< time those waits took, summed over threads */
    uint64_t wait_ns;       /**< time the calling thread waited for pieces that workers were filling */
    uint64_t send_ns;       /**< time the calling thread spent handing pieces to the link */
    uint64_t sends;         /**< transfers handed to the link: the pieces found filled together go as one */
    uint64_t span_ns;       /**< from a call's first piece queued to its last piece sent, summed over calls */
    uint64_t first_fill_ns; /**< from a call's first piece queued to that piece filled (the link's wait to start) */
} expcache_staging_stats_t;

/**
 * Copy the staging ring's counters since the cache was made or its stats
 * were reset to *out (struct_size set by the caller). Status: INVALID_ARGUMENT.
 */
EXPCACHE_API expcache_status_t expcache_staging_stats_get(const expcache_t* cache, expcache_staging_stats_t* out);

/**
 * Counters of prefetches and hints, over the whole cache. Experts are counted once per call.
 * Each expert queued ends in one of used, late, wasted or cancelled (or is still queued or
 * resident unused), and is counted in one only: a serving call's hit on a prefetched expert is
 * used; a serving call's miss never is. Hence bytes_used + bytes_late_sent <= bytes_sent
 * (since creation, or since a reset made while no prefetched expert was queued or unused).
 */
typedef struct expcache_prefetch_stats_t {
    uint32_t struct_size; /**< sizeof(expcache_prefetch_stats_t); set by the caller */
    uint32_t reserved;
    uint64_t calls;     /**< expcache_prefetch_async calls */
    uint64_t issued;    /**< experts queued (each took a slot) */
    uint64_t used;      /**< prefetched experts whose bytes were all sent before a serving call that
                             listed them (a hit of that call: first use) */
    uint64_t wasted;    /**< prefetched experts evicted or released before any use */
    uint64_t cancelled; /**< prefetches dropped before all their bytes were sent (pre-empted by a
                             serving call that did not list them or by a compact load, or a piece or
                             the in-place finish failed); slots freed */
    uint64_t skipped;   /**< ids already resident or on their way */
    uint64_t dropped;   /**< ids not prefetched: the layer's limit reached, or no slot may be taken */
    uint64_t bytes_issued, bytes_used, bytes_wasted, bytes_cancelled; /**< the experts' bytes of each */
    uint64_t bytes_sent;      /**< bytes the prefetch pieces moved over the link */
    uint64_t pieces;          /**< transfers sent (each at most half of prefetch_piece_bytes) */
    uint64_t hints;           /**< ids given to expcache_hint (once per call) */
    uint64_t hint_refreshes;  /**< hinted ids found resident and refreshed */
    uint64_t late;            /**< prefetched experts a select or batch listed while bytes of theirs were
                                   still queued: it finished them in place, as misses of its path (the
                                   rest of their bytes in its bytes_h2d); never counted used */
    uint64_t bytes_late_sent; /**< of those experts' bytes, the part the prefetch had sent (the rest moved
                                   as the misses') */
} expcache_prefetch_stats_t;

/** Copy the prefetch and hint counters to *out (struct_size set by the caller). Status: INVALID_ARGUMENT. */
EXPCACHE_API expcache_status_t expcache_prefetch_stats_get(const expcache_t* cache, expcache_prefetch_stats_t* out);

/**
 * The host pool (expcache_config_t.host_budget_bytes > 0): one tier of pinned host RAM between a
 * source the GPU cannot read (pageable memory, a file) and the device cache, shared by every class,
 * holding whole experts. Read-through: a miss of the device cache that reads such a source (a
 * decode select, a compact load or a batch on the host; a device select's feed) looks in the pool
 * first; a hit is copied from RAM, the disk not touched; a pool miss reads the source into the pool
 * (evicting, among the experts no read is copying from, the victim of the cache's policy,
 * config.policy: an instance of its own over the pool's slots, which sees the pool's hits and
 * entries), then copies it on. The pool's policy runs on the clock the cache's serving calls run
 * on, each use timed as the serving call that made it: on a device-lookup cache the device's,
 * which device selects and host-side calls advance alike, a device select's feed reading its token
 * with each miss (docs/device_lookup.md, "The host pool"). An expert whose read failed or came
 * short is never entered. The pool is cut into slots of one size when it is first used: the largest
 * expert (its parts each 64-byte aligned) among the layers of such sources registered then; an
 * expert larger than that (a layer registered later) is read past the pool. Prefetches and pinned
 * sources never use it. A layer unregistered or registered again leaves it.
 *
 * Counters per tier: the device's hits are expcache_stats_t's; these count what the device's
 * misses of such sources did next. Each such miss is one of hits (from the pool) or source_reads
 * (from the source: every such miss when there is no pool); with a pool, each source read is one
 * of inserts (entered), failed (the read failed: not entered), bypassed (read past the pool: no
 * slot free of readers, or an expert larger than a slot) or still under way.
 */
typedef struct expcache_pool_stats_t {
    uint32_t struct_size; /**< sizeof(expcache_pool_stats_t); set by the caller */
    uint32_t reserved;
    uint64_t budget_bytes; /**< config.host_budget_bytes (0: no pool) */
    uint64_t slot_bytes;   /**< bytes of one slot (0 until the pool's first use) */
    uint64_t slots;        /**< slots the budget holds (0 until the pool's first use) */
    uint64_t resident;     /**< experts in the pool now */
    uint64_t hits;         /**< device misses served from the pool */
    uint64_t bytes_hit;    /**< their bytes */
    uint64_t source_reads; /**< device misses read from the source (a disk read, for a file) */
    uint64_t bytes_source; /**< their bytes */
    uint64_t inserts;      /**< experts entered into the pool */
    uint64_t evictions;    /**< experts the pool evicted to make room */
    uint64_t failed;       /**< reads that failed or came short: not entered */
    uint64_t bypassed;     /**< source reads past the pool (no slot free of readers, or too large) */
} expcache_pool_stats_t;

/**
 * Copy the host pool's counters since the cache was made or its stats were reset (the
 * budget, slots and residents as they are now) to *out (struct_size set by the caller). On a
 * device-lookup cache a device select's pool counts are made by the feed's threads: read them
 * after synchronizing the select's stream. Status: INVALID_ARGUMENT.
 */
EXPCACHE_API expcache_status_t expcache_pool_stats_get(const expcache_t* cache, expcache_pool_stats_t* out);

/** Zero every counter (every class and path, the staging ring's, prefetch's and the pool's too). Status:
 * INVALID_ARGUMENT. */
EXPCACHE_API expcache_status_t expcache_stats_reset(expcache_t* cache);

/* ---------------------------------------------------------------------- */
/* Memory kept alive past the cache                                         */
/* ---------------------------------------------------------------------- */

/**
 * A reference to one device allocation of a cache's (a class's bank, a staging
 * buffer), keeping its memory allocated until released, after expcache_destroy too;
 * a bank a reference keeps stays mapped through releases of its class.
 * Bindings hand one out with every zero-copy view, so a tensor made from a view can
 * never read freed memory. The *bytes* follow the usual validity rule: a slot may hold
 * another expert after the cache's next serving call; once the cache stops using the
 * allocation (expcache_release_all, a class released or reused, expcache_destroy) the
 * bytes stay as they were (stale, readable) until the last reference goes.
 */
typedef struct expcache_memory_ref_t expcache_memory_ref_t;

/**
 * Keep alive the allocation that holds the device address `ptr` (one the cache
 * handed out). Takes the cache's lock; cheap (a lookup). Status: INVALID_ARGUMENT
 * (handle, NULL out_ref, or `ptr` not inside memory the cache holds).
 */
EXPCACHE_API expcache_status_t expcache_memory_retain(expcache_t* cache, const void* ptr,
                                                      expcache_memory_ref_t** out_ref);

/**
 * Drop a reference; the last one of an allocation the cache no longer uses frees it
 * (on the CUDA backend cudaFree, which waits for the device). Any thread, any time,
 * before or after expcache_destroy; takes no cache lock, so a dropped-memory callback
 * (below) may call it. NULL is ignored. In a child made by fork() it does nothing
 * (the memory is the parent's).
 */
EXPCACHE_API void expcache_memory_release(expcache_memory_ref_t* ref);

/**
 * Called when a call let go of allocations that references keep alive, and before a
 * release would give back a bank that references keep (so a binding that keeps
 * references for its own bookkeeping, e.g. reusable views, can drop them and let the
 * memory go). Called on the thread making the call, with the cache's mutex held: it
 * must not call into the same cache (expcache_memory_release excepted).
 */
typedef void (*expcache_memory_dropped_fn)(void* user);

/** Set (fn NULL: clear) the dropped-memory callback. Status: INVALID_ARGUMENT. */
EXPCACHE_API expcache_status_t expcache_memory_set_dropped_callback(expcache_t* cache, expcache_memory_dropped_fn fn,
                                                                    void* user);

/* ---------------------------------------------------------------------- */
/* Logging                                                                 */
/* ---------------------------------------------------------------------- */

/**
 * Receives one log line (no trailing newline) and its level: EXPCACHE_LOG_WARNING
 * for trouble a user must see (a class whose cap is 0 because no device memory is
 * left after the reserve: every expert of it is loaded directly, nothing cached),
 * NOTICE for state changes, DEBUG for per-call lines. Called on the thread making
 * the call, after the call's work and with no lock of the library held, just before
 * the exported function returns: the callback may call any function of the library,
 * on this cache too (expcache_destroy included; its own lines follow it), and
 * expcache_last_error() still reads the outer call's message afterwards. Lines logged
 * by the library's own threads outside any call are delivered on those threads.
 */
typedef void (*expcache_log_fn)(void* user, uint32_t level, const char* message);

/**
 * Route this cache's log lines to fn (called with `user`) instead of stderr;
 * fn NULL restores stderr. Status: INVALID_ARGUMENT.
 */
EXPCACHE_API expcache_status_t expcache_log_set_callback(expcache_t* cache, expcache_log_fn fn, void* user);

/** Set the log level (EXPCACHE_LOG_*). Status: INVALID_ARGUMENT (handle, or level > EXPCACHE_LOG_DEBUG). */
EXPCACHE_API expcache_status_t expcache_log_set_level(expcache_t* cache, uint32_t level);

#ifdef __cplusplus
}
#endif

#endif /* EXPCACHE_H */
