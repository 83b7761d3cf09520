// The cache: the one object behind an expcache_t. It orchestrates the rooms, each of which owns
// its own state: LayerTable (layers.hpp: registered layers and their sources), ClassTable
// (class_table.hpp: size classes, slots, residency, policies, caps, counters), StreamOrder
// (stream_order.hpp), PrefetchCoordinator (prefetch_coordinator.hpp), DeviceLookup
// (device_lookup.hpp: the residency a device-lookup cache keeps on the device), DeviceArena
// (device_arena.hpp: every allocation) and the backend. Every public method runs under the
// cache's mutex, called by the ABI layer with validated handles.
//
// Its methods by file: cache.cpp (lifetime, layout, control), serve.cpp (what every serving call
// shares: its preamble, uploads and staging buffers), slots.cpp (a call's slot fill, shared by
// decode and batch), serve_select.cpp, serve_compact.cpp, serve_batch.cpp, serve_device.cpp
// (one path each),
// prefetch.cpp (the prefetch calls' entry points) and inspect.cpp (reads, checksums, counters,
// fault injection).
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "backend/instrumented.hpp"
#include "call.hpp"
#include "class_table.hpp"
#include "device_arena.hpp"
#include "device_lookup.hpp"
#include "errors.hpp"
#include "expcache.h"
#include "host_pool.hpp"
#include "layers.hpp"
#include "log.hpp"
#include "prefetch_coordinator.hpp"
#include "stream_order.hpp"

namespace expcache {

constexpr uint32_t kMaxCompact = 1u << 20;            // ids of one load_compact, experts of one checksum
constexpr uint64_t kMaxBatchIds = uint64_t(1) << 26;  // ids of one batch_prepare
constexpr uint32_t kMaxInsert = 1u << 20;             // ids of one insert

struct BatchState {
    uint64_t id = 0;
    uint32_t layer = 0;
    int32_t cls = -1;
    std::vector<int32_t> held;
    void* staging = nullptr;  // a batch by address: its staged experts
    bool rows = false;        // a batch by slot id that staged experts in its class's batch rows
};

// The unfinished prefill batches.
struct Batches {
    std::vector<BatchState> open;
    uint64_t next_id = 1;
};

// Staging the cache keeps between calls (compact's buffer): it only grows, so calls of one size
// reuse it.
struct OwnedBuffer {
    void* ptr = nullptr;
    uint64_t bytes = 0;
};
struct StagingBuffers {
    OwnedBuffer compact;  // load_compact's output
};

class Cache {
public:
    static expcache_status_t create(const expcache_config_t& config, std::unique_ptr<Cache>* out);
    ~Cache();

    uint32_t backend_kind() const { return backend_->kind(); }
    // By path, or (path nullptr) by the caller's descriptor fd.
    expcache_status_t open_file(const char* path, int fd, uint32_t* out_file);
    expcache_status_t register_layer(uint32_t layer, const expcache_layer_desc_t& desc);
    // n layers at once (layers[i] described by descs[i]), all or nothing.
    expcache_status_t register_layers(uint32_t n, const uint32_t* layers, const expcache_layer_desc_t* descs);
    // The layer's residents leave (their slots free for its class's other layers), its source is
    // forgotten, and it may be registered again; refused while a batch of it is open.
    expcache_status_t unregister_layer(uint32_t layer);
    // budget.cpp: the budgets (as expcache_config_t's), or the reserve, replaced while the cache
    // keeps its residents; every class's cap recomputed as create computes them (apply_budgets).
    expcache_status_t set_budget(uint64_t budget_experts, uint64_t budget_bytes);
    expcache_status_t set_reserve(uint64_t reserve_bytes);
    // budget.cpp: the budgets in force, and the device's memory.
    expcache_status_t get_budget(uint64_t* budget_experts, uint64_t* budget_bytes, uint32_t* free_memory) const;
    expcache_status_t device_memory(uint64_t* free_bytes, uint64_t* total_bytes);
    // EXPCACHE_BUDGET_FREE_MEMORY in cfg->budget_bytes: replaced by the free memory (with the cache's
    // own slots) less the reserve, logged; OUT_OF_DEVICE_MEMORY when that is nothing.
    expcache_status_t measure_budget(expcache_config_t* cfg);
    expcache_status_t select(uint32_t layer, const uint32_t* ids, uint32_t k, void* stream,
                             expcache_expert_ptrs_t* out);
    // ids: id_bits 32 or 64, host memory.
    expcache_status_t select_ids(uint32_t layer, const void* ids, uint32_t id_bits, uint32_t k, void* stream,
                                 expcache_expert_ptrs_t* out);
    expcache_status_t select_split(uint32_t layer, const uint32_t* ids, uint32_t k, void* stream,
                                   expcache_expert_ptrs_t* out, uint8_t* out_resident, void** out_ready);
    // ids: id_bits 32 or 64, host memory; out: host memory.
    expcache_status_t select_slots(uint32_t layer, const void* ids, uint32_t id_bits, uint32_t k, int32_t* out,
                                   void* stream);
    expcache_status_t wait_ready(void* ready, void* stream);
    expcache_status_t prefetch(uint32_t layer, const uint32_t* ids, uint32_t n, void* stream, uint32_t* out_queued);
    expcache_status_t hint(uint32_t layer, const uint32_t* ids, uint32_t n);
    // serve_insert.cpp: ids put in by ascending priority (nullptr: the given order), each expert
    // once at its highest, counted on the control path.
    expcache_status_t insert(uint32_t layer, const uint32_t* ids, const float* priorities, uint32_t n, void* stream);
    expcache_status_t get_prefetch_stats(expcache_prefetch_stats_t* out) const;
    expcache_status_t prefetch_wait();
    expcache_status_t prefetch_pause(bool paused);
    expcache_status_t spin(void* stream, uint64_t ns);
    expcache_status_t load_compact(uint32_t layer, const uint32_t* ids, uint32_t n, void* stream,
                                   expcache_compact_t* out);
    // Exactly one of out_ptrs (a batch by address) and out_slots (by slot id) is given.
    expcache_status_t batch_prepare(uint32_t layer, const uint32_t* ids, uint64_t n, void* stream, uint32_t* out_ids,
                                    expcache_expert_ptrs_t* out_ptrs, int32_t* out_slots, uint32_t* out_count,
                                    uint64_t* out_batch);
    // ids: id_bits 32 or 64, host memory.
    expcache_status_t batch_prepare_slots(uint32_t layer, const void* ids, uint32_t id_bits, uint64_t n, void* stream,
                                          uint32_t* out_ids, int32_t* out_slots, uint32_t* out_count,
                                          uint64_t* out_batch);
    expcache_status_t batch_finish(uint64_t batch, void* stream);
    // A host call's ids of id_bits 32 or 64 (the *_ids twins of the C ABI) as 32 bits into *out;
    // n checked first (1..max_n, `count_name` in the message), so nothing is allocated for a
    // count the call refuses.
    static expcache_status_t narrow_ids(uint32_t layer, const void* ids, uint32_t id_bits, uint64_t n, uint64_t max_n,
                                        const char* count_name, std::vector<uint32_t>* out);
    // narrow_ids for a call of at most EXPCACHE_MAX_SELECT ids (a decode call's k, a prefetch's or
    // hint's n), into the calling thread's buffer (*out): the hot path allocates nothing.
    static expcache_status_t narrow_decode(uint32_t layer, const void* ids, uint32_t id_bits, uint32_t k,
                                           const uint32_t** out, const char* count_name = "k");
    // out_counts: 2 uint32 on the device (distinct experts, misses), or nullptr when not wanted.
    expcache_status_t select_device(uint32_t layer, const void* ids, uint32_t id_bits, uint32_t n, uint32_t k,
                                    int32_t* out_slots, uint32_t* out_counts, void* stream);
    expcache_status_t bank(uint32_t index, expcache_bank_t* out);
    expcache_status_t table_reads(uint32_t layer, uint64_t* out);
    expcache_status_t release_all();
    expcache_status_t synchronize(void* stream);
    expcache_status_t read_resident(uint32_t layer, uint32_t expert, void* dst, uint64_t dst_bytes,
                                    uint32_t* out_resident);
    expcache_status_t read_device(const void* src, void* dst, uint64_t n);
    expcache_status_t checksum(uint32_t layer, const expcache_expert_ptrs_t* ptrs, uint32_t n, void* stream,
                               uint64_t* out_sums);
    expcache_status_t checksum_async(uint32_t layer, const expcache_expert_ptrs_t* ptrs, uint32_t n, void* stream,
                                     uint32_t first);
    expcache_status_t checksum_results(uint32_t first, uint32_t n, uint64_t* out);
    // slots in device memory (read by the kernel), or with host_slots in host memory (staged on
    // `stream` first: expcache_testing_bank_checksum_host_slots_async).
    expcache_status_t bank_checksum_async(uint32_t layer, const int32_t* slots, uint32_t n, void* stream,
                                          uint32_t first, bool host_slots = false);
    expcache_status_t class_count(uint32_t* out) const;
    expcache_status_t class_info(uint32_t index, expcache_class_info_t* out) const;
    expcache_status_t layer_class(uint32_t layer, uint32_t* out);
    // The class holding experts of these part sizes now (bound by one of their layers).
    expcache_status_t find_class(const uint64_t part_bytes[kMaxParts], uint32_t* out) const;  // 0 past the parts
    expcache_status_t get_stats(uint32_t index, uint32_t path, expcache_stats_t* out) const;
    // Every class's info and counters at once: infos[n], stats[n * EXPCACHE_NUM_PATHS] (n <= max_classes).
    expcache_status_t read_stats(uint32_t n, expcache_class_info_t* infos, expcache_stats_t* stats) const;
    expcache_status_t get_staging_stats(expcache_staging_stats_t* out) const;
    expcache_status_t get_pool_stats(expcache_pool_stats_t* out) const;
    expcache_status_t reset_stats();
    expcache_status_t set_log_callback(expcache_log_fn fn, void* user);
    expcache_status_t set_log_level(uint32_t level);
    expcache_status_t retain_memory(const void* ptr, std::shared_ptr<KeptMemory>* out);
    expcache_status_t set_dropped_callback(expcache_memory_dropped_fn fn, void* user);
    expcache_status_t inject_alloc_failures(uint64_t skip, uint64_t count);
    expcache_status_t inject_copy_failures(uint64_t skip, uint64_t count);
    expcache_status_t inject_staging_failures(uint64_t skip, uint64_t count);
    expcache_status_t device_bytes_in_use(uint64_t* out) const;
    expcache_status_t device_reads(uint64_t* out_syncs, uint64_t* out_copies) const;

private:
    Cache(const expcache_config_t& config, std::unique_ptr<InstrumentedBackend> backend,
          std::unique_ptr<LookupKernels> lookup_kernels);

    // Serializes a call and makes the backend's device current for its length; at its end, tells
    // the dropped-memory callback if the call let go of kept memory.
    class CallScope {
    public:
        explicit CallScope(const Cache& c) : lock_(c.mu_), cache_(c), disowned_(c.arena_.disowned()) {
            c.backend_->enter();
        }
        ~CallScope() {
            cache_.arena_.notify_dropped(disowned_);
            cache_.backend_->leave();
        }

    private:
        std::lock_guard<std::mutex> lock_;
        const Cache& cache_;
        const uint64_t disowned_;
    };

    // A call's uploads from pageable and file sources may still be running on the
    // backend's staging threads; all are enqueued on the stream before the call
    // returns. If one failed, the slots the call filled hold wrong bytes: they are
    // made free again and the call fails, so a later hit never serves them.
    class UploadScope {
    public:
        UploadScope(Cache& c, std::vector<std::pair<int32_t, int32_t>>& inserted) : c_(c), inserted_(inserted) {
            inserted_.clear();
        }
        ~UploadScope() { abandon(); }
        UploadScope(const UploadScope&) = delete;
        UploadScope& operator=(const UploadScope&) = delete;

        // The end of a call that succeeded so far.
        expcache_status_t settle() {
            settled_ = true;
            return c_.settle_uploads(inserted_);
        }
        // The end of a call that failed, and the point before freeing memory that its
        // uploads may still write to: wait for them; the call's own error stays the message.
        void abandon();

    private:
        Cache& c_;
        std::vector<std::pair<int32_t, int32_t>>& inserted_;  // the call's filled slots (CallScratch)
        bool settled_ = false;
    };

    // A serving call's own lists (call.hpp), for its length: made of the capacity the cache
    // keeps between calls (spare_scratch_) and given back when the call ends, so the hot path
    // allocates nothing and no list outlives the call that filled it.
    struct CallLists : CallScratch {
        explicit CallLists(Cache& c) : CallScratch(std::move(c.spare_scratch_)), cache(c) {}
        ~CallLists() { cache.spare_scratch_ = std::move(static_cast<CallScratch&>(*this)); }
        CallLists(const CallLists&) = delete;
        CallLists& operator=(const CallLists&) = delete;
        Cache& cache;
    };

    // One serving call, from taking the lock to settling its uploads (members destroyed in
    // reverse: the uploads settle while the lock is still held and the call's lists still
    // exist). open_call() fills in the rest; the call owns its lists.
    struct ServeCall {
        ServeCall(Cache& cache, uint32_t on_path, uint32_t layer, void* on_stream)
            : scope(cache),
              scratch(cache),
              uploads(cache, scratch.inserted),
              path(on_path),
              layer_index(layer),
              stream(on_stream) {}
        CallScope scope;
        CallLists scratch;
        UploadScope uploads;
        const uint32_t path;
        const uint32_t layer_index;
        void* const stream;
        void* copy_stream = stream;  // where the call's uploads go (a split select: the cache's own)
        const char* ptrs = nullptr;  // a call handing out expcache_expert_ptrs_t: the calls that serve the
                                     // layer by slot id instead (for a layer of other than three parts)
        LayerState* layer = nullptr;
        int32_t c = -1;  // the layer's class
        const ClassState* cls = nullptr;
    };

    // cache.cpp: the class table's releases, the classes vacated first (prefetches settled, the
    // device done with its slots: PrefetchCoordinator::vacate), so that the table never calls out.
    // bind_class: PrefetchCoordinator::bind_class (ClassTable::bind, vacating the class it reuses).
    expcache_status_t bind_class(uint32_t layer, uint32_t path, int32_t* out_cls);
    expcache_status_t release_unheld(uint32_t path);

    // serve.cpp
    expcache_status_t validate_request(uint32_t layer, const uint32_t* ids, uint64_t n, uint64_t max_n,
                                       const char* count_name) const;
    // per_slot: the call orders each slot it reads or writes itself (StreamOrder::order_slot).
    expcache_status_t begin_call(void* stream, bool per_slot = false);
    // admit: a path's own check, made after the request's and before anything changes.
    expcache_status_t open_call(ServeCall& call, const uint32_t* ids, uint64_t n, uint64_t max_n,
                                const char* count_name, expcache_status_t (Cache::*admit)() const = nullptr);
    expcache_status_t copy_expert(const LayerState& layer, uint32_t expert, unsigned char* const dst[kMaxParts],
                                  void* stream);
    // serve_pool.cpp: copy_expert of a pageable or file source through the host pool; *done false:
    // the pool did not take it (none, full of readers, too large), read the source as before.
    expcache_status_t copy_through_pool(const LayerState& layer, uint32_t expert, unsigned char* const dst[kMaxParts],
                                        void* stream, bool* done);
    // The pool slots this call's uploads read, let go once they have read them (settle_uploads).
    void release_pool_leases();
    // A layer just registered: the pool forgets what it held of it, and notes its experts' size.
    void note_pool_layer(uint32_t layer);
    // Frees the slots `inserted` lists (the call's) if an upload failed.
    expcache_status_t settle_uploads(std::vector<std::pair<int32_t, int32_t>>& inserted);
    expcache_status_t alloc_staging(uint64_t bytes, int32_t c, uint32_t path, void** out);
    expcache_status_t reserve_buffer(ServeCall& call, OwnedBuffer& buf, uint64_t bytes, bool may_release);

    // slots.cpp
    // Serves the call's unique experts from slots of its class; those left without one are
    // scratch.pending[0, *out_direct), for stage_overflow(). batch: nullptr for decode.
    expcache_status_t fill_slots(ServeCall& call, BatchState* batch, uint32_t* out_direct);
    // fill_slots on a device-lookup cache: the slots the device's residency gives (DeviceLookup::serve).
    expcache_status_t fill_on_device(ServeCall& call, BatchState* batch, uint32_t* out_direct);
    expcache_status_t stage_overflow(ServeCall& call, unsigned char* buffer, uint64_t row, uint32_t direct);

    // serve.cpp: host ids of id_bits 32 or 64 as 32 bits into *out (one that is not, negative or
    // over 32 bits, is out of range for any layer). Made before the call takes the cache's lock:
    // *out is the caller's own (a decode call's: its thread's buffer).
    static expcache_status_t narrow(uint32_t layer, const void* ids, uint32_t id_bits, uint64_t n,
                                    std::vector<uint32_t>* out);
    // The row of the slot (or staging or batch row) at `ptrs` in class c's bank.
    int32_t row_of(int32_t c, const expcache_expert_ptrs_t& ptrs) const;

    // serve_select.cpp
    // A decode call's slots; what gets none is staged in the class bank's staging rows.
    expcache_status_t serve_decode(ServeCall& call, uint32_t k);
    void write_ptrs(const ServeCall& call, const uint32_t* ids, uint32_t k, expcache_expert_ptrs_t* out) const;

    // serve_compact.cpp
    expcache_status_t compact_from_table(ServeCall& call, const uint32_t* ids, uint32_t n, unsigned char* base,
                                         const uint64_t* off);
    expcache_status_t compact_on_device(ServeCall& call, const uint32_t* ids, uint32_t n, unsigned char* base,
                                        const uint64_t* off);
    // serve_batch.cpp
    expcache_status_t batch_room() const;
    // serve_select.cpp
    expcache_status_t split_room() const;
    // cache.cpp
    expcache_status_t refuse_on_device_lookup(const char* what) const;
    expcache_status_t device_table_fits(uint32_t layer, uint32_t num_experts) const;
    // budget.cpp: the config's budgets and reserve replaced by next's and every class resized to
    // the cap they give; refused, nothing changed, when a class that must shrink is held by a batch.
    expcache_status_t apply_budgets(const expcache_config_t& next);
    // serve_device.cpp
    expcache_status_t device_call(uint32_t layer, const char* what) const;
    // A batch's slots let go (on a device-lookup cache, those no batch holds now unpinned on `stream`).
    expcache_status_t unhold(const BatchState& batch, void* stream);

    // inspect.cpp
    // A device-lookup cache's counters and residents (one copy), for const readers.
    expcache_status_t device_snapshot(DeviceSnapshot* out) const;
    void fill_info(int32_t c, const DeviceSnapshot& snap, expcache_class_info_t* out) const;
    void fill_stats(int32_t c, uint32_t path, const DeviceSnapshot& snap, expcache_stats_t* out) const;
    expcache_status_t checksum_jobs(uint32_t layer, const expcache_expert_ptrs_t* ptrs, uint32_t n,
                                    std::vector<ChecksumJob>* jobs);

    mutable std::mutex mu_;
    std::unique_ptr<InstrumentedBackend> backend_;  // the backend, with fault injection and test kernels
    DeviceArena arena_;                             // after backend_, which it uses
    expcache_config_t config_ = {};
    bool free_memory_budget_ = false;  // budget_bytes measured from free memory (EXPCACHE_BUDGET_FREE_MEMORY)
    Log log_;
    Health health_;
    HostPool pool_;  // after backend_ (its link allocates the pool), before lookup_ (the feed reads it)
    std::vector<HostPool::Lease> pool_leases_;  // this call's pool slots its uploads read
    bool pool_warned_ = false;                  // a layer's experts do not fit the pool: said once
    LayerTable layers_;
    ClassTable classes_;
    DeviceLookup lookup_;
    StreamOrder streams_;
    CallClock clock_;
    CallScratch spare_scratch_;  // a serving call's lists between calls: capacity only (CallLists)
    PrefetchCoordinator prefetch_;
    Batches batches_;
    StagingBuffers staging_;
    bool classes_warned_ = false;  // the layout's size classes outnumber max_classes: said once
};

}  // namespace expcache
