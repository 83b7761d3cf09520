// The cache core: layers, size classes, slots, budgets and the three
// serving paths. Backend-independent; every method is called by the ABI
// layer with validated handles and runs under the cache's mutex.
//
// One class, its members defined by concept: cache.cpp (lifetime, logging,
// layout, files), classes.cpp (size classes, budgets, caps), slots.cpp (a
// call's slot fill, shared by decode and batch), serve.cpp (what every
// serving call shares: its preamble, uploads and staging buffers),
// serve_select.cpp, serve_compact.cpp, serve_batch.cpp (one path each) and
// inspect.cpp (reads, checksums, counters, fault injection).
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "device_arena.hpp"
#include "expcache.h"
#include "policy/policy.hpp"
#include "prefetcher.hpp"

namespace expcache {

constexpr uint64_t kAlign = 256;  // where each part of a slot, and of the compact buffer, starts
constexpr uint64_t kGiB = uint64_t(1) << 30;
constexpr uint32_t kMaxCompact = 1u << 20;  // ids of one load_compact, experts of one checksum

inline uint64_t align_up(uint64_t v) { return (v + kAlign - 1) & ~(kAlign - 1); }

enum Part { kGate = 0, kUp = 1, kDown = 2, kParts = 3 };

struct LayerState {
    bool registered = false;
    bool pinned = false;
    uint32_t num_experts = 0;
    const SourceFile* file = nullptr;  // EXPCACHE_SOURCE_FILE: base[] are offsets into it
    uint64_t bytes[kParts] = {};
    uint64_t stride[kParts] = {};
    const unsigned char* base[kParts] = {};
    int32_t rank = 0;      // position among the registered layers (the policy clock's pos)
    uint32_t key_base = 0; // expert e's policy key is key_base + e
    int32_t cls = -1;      // bound class index, valid while classes_[cls].gen == cls_gen
    uint64_t cls_gen = 0;
    uint32_t prefetched = 0;         // experts prefetched since the layer's last serving call (the limit)
    std::vector<int32_t> slot_of;    // per expert: slot index or -1
    std::vector<uint64_t> seen;      // per expert: last call that listed it (dedupe without clearing)
    std::vector<uint32_t> seen_pos;  // per expert: its index in that call's unique list

    uint64_t expert_bytes() const { return bytes[kGate] + bytes[kUp] + bytes[kDown]; }
    const unsigned char* source(int part, uint32_t expert) const { return base[part] + stride[part] * expert; }
};

struct SlotState {
    unsigned char* dev = nullptr;
    int32_t layer = -1;  // -1: free
    uint32_t expert = 0;
    uint32_t holds = 0;       // unfinished batches using it
    uint64_t last_call = 0;   // protects it from eviction during that call (and from a prefetch's
                              // during the next one)
    uint8_t prefetch = 0;     // kPrefetch*: what a prefetch put here and nothing used yet
    bool copy_pending = false;  // a prefetch's bytes may still cross on the copy stream: a call that
                                // reads or rewrites the slot waits for that stream first (order_slot)
};

enum PrefetchState : uint8_t {
    kPrefetchNone = 0,
    kPrefetchLoading = 1,  // queued on the prefetch thread: never evicted, never served; every
                           // serving call cancels it first
    kPrefetchUnused = 2,   // every byte sent; the first use counts it as used, an eviction as wasted
    kPrefetchPartial = 3,  // cancelled by the serving call under way with bytes left to send: if that call
                           // lists it, it sends the rest into the same slot (a miss, counted late);
                           // otherwise the slot is freed (cancelled)
};

struct ClassState {
    bool in_use = false;
    uint64_t gen = 0;
    uint64_t key[kParts] = {};
    uint64_t part_off[kParts] = {};
    uint64_t slot_bytes = 0;
    uint64_t last_used = 0;  // call id, for reusing the least recently used class
    std::vector<SlotState> slots;
    std::vector<int32_t> free_slots;
    std::vector<void*> slabs;
    std::unique_ptr<Policy> policy;
    uint64_t target = 0, cap = 0;
    bool cap_valid = false;      // recompute before the next growth
    bool cap_announced = false;  // a notice was given for `cap`
    uint64_t resident = 0, held = 0, layers = 0;
    expcache_stats_t stats[EXPCACHE_NUM_PATHS] = {};

    // Where each part of the slot (or staging entry laid out like one) at `base` goes.
    void parts_at(unsigned char* base, unsigned char* out[kParts]) const {
        for (int p = 0; p < kParts; ++p) out[p] = base + part_off[p];
    }
    expcache_expert_ptrs_t ptrs_at(unsigned char* base) const {
        return {base + part_off[kGate], base + part_off[kUp], base + part_off[kDown]};
    }
};

struct BatchState {
    uint64_t id = 0;
    int32_t cls = -1;
    std::vector<int32_t> held;
    void* staging = nullptr;
};

// Staging the cache keeps between calls (compact's buffer, decode's overflow): it only grows,
// so calls of one size reuse it.
struct OwnedBuffer {
    void* ptr = nullptr;
    uint64_t bytes = 0;
};

class Cache {
public:
    static expcache_status_t create(const expcache_config_t& config, std::unique_ptr<Cache>* out);
    ~Cache();

    uint32_t backend_kind() const { return backend_->kind(); }
    expcache_status_t open_file(const char* path, uint32_t* out_file);
    expcache_status_t register_layer(uint32_t layer, const expcache_layer_desc_t& desc);
    expcache_status_t select(uint32_t layer, const uint32_t* ids, uint32_t k, void* stream,
                             expcache_expert_ptrs_t* out);
    expcache_status_t select_split(uint32_t layer, const uint32_t* ids, uint32_t k, void* stream,
                                   expcache_expert_ptrs_t* out, uint8_t* out_resident, void** out_ready);
    expcache_status_t wait_ready(void* ready, void* stream);
    expcache_status_t prefetch(uint32_t layer, const uint32_t* ids, uint32_t n, void* stream, uint32_t* out_queued);
    expcache_status_t hint(uint32_t layer, const uint32_t* ids, uint32_t n);
    expcache_status_t get_prefetch_stats(expcache_prefetch_stats_t* out) const;
    expcache_status_t prefetch_wait();
    expcache_status_t prefetch_pause(bool paused);
    expcache_status_t spin(void* stream, uint64_t ns);
    expcache_status_t load_compact(uint32_t layer, const uint32_t* ids, uint32_t n, void* stream,
                                   expcache_compact_t* out);
    expcache_status_t batch_prepare(uint32_t layer, const uint32_t* ids, uint64_t n, void* stream,
                                    uint32_t* out_ids, expcache_expert_ptrs_t* out_ptrs, uint32_t* out_count,
                                    uint64_t* out_batch);
    expcache_status_t batch_finish(uint64_t batch, void* stream);
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
    expcache_status_t class_count(uint32_t* out) const;
    expcache_status_t class_info(uint32_t index, expcache_class_info_t* out) const;
    expcache_status_t layer_class(uint32_t layer, uint32_t* out);
    expcache_status_t get_stats(uint32_t index, uint32_t path, expcache_stats_t* out) const;
    expcache_status_t get_staging_stats(expcache_staging_stats_t* out) const;
    expcache_status_t reset_stats();
    expcache_status_t set_log_callback(expcache_log_fn fn, void* user);
    expcache_status_t set_log_level(uint32_t level);
    expcache_status_t retain_memory(const void* ptr, std::shared_ptr<KeptMemory>* out);
    expcache_status_t set_dropped_callback(expcache_memory_dropped_fn fn, void* user);
    expcache_status_t inject_alloc_failures(uint64_t skip, uint64_t count);
    expcache_status_t inject_copy_failures(uint64_t skip, uint64_t count);
    expcache_status_t inject_staging_failures(uint64_t skip, uint64_t count);
    expcache_status_t device_bytes_in_use(uint64_t* out) const;

private:
    Cache(const expcache_config_t& config, std::unique_ptr<Backend> backend);

    // Serializes a call and makes the backend's device current for its length.
    // At its end, tells the dropped-memory callback if the call let go of kept memory.
    class CallScope {
    public:
        explicit CallScope(const Cache& c)
            : lock_(c.mu_), cache_(c), disowned_(c.arena_.disowned()) {
            c.backend_->enter();
        }
        ~CallScope() {
            if (cache_.arena_.disowned() != disowned_ && cache_.dropped_fn_) cache_.dropped_fn_(cache_.dropped_user_);
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
        explicit UploadScope(Cache& c) : c_(c) { c_.inserted_.clear(); }
        ~UploadScope() { abandon(); }
        UploadScope(const UploadScope&) = delete;
        UploadScope& operator=(const UploadScope&) = delete;

        // The end of a call that succeeded so far.
        expcache_status_t settle() {
            settled_ = true;
            return c_.settle_uploads();
        }
        // The end of a call that failed, and the point before freeing memory that its
        // uploads may still write to: wait for them; the call's own error stays the message.
        void abandon();

    private:
        Cache& c_;
        bool settled_ = false;
    };

    // One serving call, from taking the lock to settling its uploads (members destroyed in
    // reverse: the uploads settle while the lock is still held). open_call() fills in the rest.
    struct ServeCall {
        ServeCall(Cache& cache, uint32_t on_path, uint32_t layer, void* on_stream)
            : scope(cache), uploads(cache), path(on_path), layer_index(layer), stream(on_stream) {}
        CallScope scope;
        UploadScope uploads;
        const uint32_t path;
        const uint32_t layer_index;
        void* const stream;
        void* copy_stream = stream;  // where the call's uploads go (a split select: the cache's own)
        LayerState* layer = nullptr;
        int32_t c = -1;  // the layer's class
        ClassState* cls = nullptr;
        expcache_stats_t* st = nullptr;  // the class's counters of this path
    };

    // cache.cpp
    void log(uint32_t level, const char* fmt, ...)
#if defined(__GNUC__)
        __attribute__((format(printf, 3, 4)))
#endif
        ;
    expcache_status_t check(expcache_status_t s);
    expcache_status_t usable() const;
    expcache_status_t validate_layer(uint32_t layer) const;

    // classes.cpp
    int32_t bound_class(const LayerState& layer) const;
    expcache_status_t bind(uint32_t layer, uint32_t path, int32_t* out_cls);
    void activate_class(int32_t c, const LayerState& layer);
    expcache_status_t release_class(int32_t c, uint32_t path);
    expcache_status_t release_unheld(uint32_t path);
    uint64_t class_target(const ClassState& cls) const;
    std::string zero_target_reason(const ClassState& cls) const;
    expcache_status_t refresh_cap(int32_t c, uint32_t path);
    void announce_cap(int32_t c, uint32_t path, const char* why, const char* fix = "");
    expcache_status_t grow(int32_t c, uint32_t path);
    std::string class_name(const ClassState& cls) const;

    // slots.cpp
    enum class Evict { kNo, kDemand, kPrefetch };  // kPrefetch: never a slot of the current or previous call
    expcache_status_t acquire_slot(int32_t c, bool allow_grow, Evict evict, uint32_t path, int32_t* out);
    void evict(int32_t c, int32_t slot, uint32_t path);
    void uninstall(int32_t c, int32_t slot);
    // Serves the call's unique experts from slots of its class; those left without one are
    // pending_[0, *out_direct), for stage_overflow(). batch: nullptr for decode.
    expcache_status_t fill_slots(ServeCall& call, BatchState* batch, uint32_t* out_direct);
    expcache_status_t stage_overflow(ServeCall& call, unsigned char* base, uint32_t direct);

    // serve.cpp
    expcache_status_t validate_request(uint32_t layer, const uint32_t* ids, uint64_t n, uint64_t max_n,
                                       const char* count_name) const;
    // per_slot: the call orders each slot it reads or writes itself (order_slot), so what
    // prefetches sent into other slots needs no wait; else the stream waits for all of it.
    expcache_status_t begin_call(void* stream, bool per_slot = false);
    // `stream` waits for everything the copy stream was given so far.
    expcache_status_t fence_copy(void* stream);
    // Before `stream` reads or writes slot s of class c: waits for the copy stream if a prefetch
    // sent bytes into the slot since the last fence_copy.
    expcache_status_t order_slot(int32_t c, int32_t s, void* stream);
    // After the device was synchronized: nothing the copy stream sent is still crossing.
    void forget_copy_pending();
    // admit: a path's own check, made after the request's and before anything changes.
    expcache_status_t open_call(ServeCall& call, const uint32_t* ids, uint64_t n, uint64_t max_n,
                                const char* count_name, expcache_status_t (Cache::*admit)() const = nullptr);
    void dedupe(LayerState& layer, const uint32_t* ids, uint64_t n);
    expcache_status_t copy_expert(const LayerState& layer, uint32_t expert, unsigned char* const dst[kParts],
                                  void* stream);
    // One transfer of copy_expert(); an exception from the backend (setting up the staging ring:
    // its memory, its threads) becomes a failed status, so the caller frees the slot it filled.
    expcache_status_t upload(const LayerState& layer, unsigned char* dst, const unsigned char* src, uint64_t bytes,
                             void* stream);
    expcache_status_t injected_copy_failure();
    expcache_status_t settle_uploads();
    expcache_status_t alloc_staging(uint64_t bytes, int32_t c, uint32_t path, void** out);
    expcache_status_t reserve_buffer(ServeCall& call, OwnedBuffer& buf, uint64_t bytes, bool may_release);

    // serve_select.cpp
    expcache_status_t serve_decode(ServeCall& call, const uint32_t* ids, uint32_t k, expcache_expert_ptrs_t* out);

    // serve_prefetch.cpp
    // cancel: every queued prefetch is taken off the queue; keep_partial: they stay kPrefetchPartial for
    // the serving call under way to finish or free (resolve_partial), else they are freed at once.
    expcache_status_t settle_prefetches(bool cancel, bool keep_partial = false);
    void resolve_partial(ServeCall& call);
    void cancel_prefetch(int32_t c, int32_t slot);
    expcache_status_t finish_partial(ServeCall& call, int32_t slot, bool cold);
    void note_use(ClassState& cls, int32_t slot);
    void drop_prefetched(SlotState& slot);
    // A piece failure settle_prefetches() recorded, returned (and forgotten) once; else OK.
    expcache_status_t take_prefetch_error();
    Prefetcher& prefetcher();

    // serve_batch.cpp
    expcache_status_t batch_room() const;
    void unhold(const BatchState& batch);

    // inspect.cpp
    expcache_status_t checksum_jobs(uint32_t layer, const expcache_expert_ptrs_t* ptrs, uint32_t n);

    mutable std::mutex mu_;
    std::unique_ptr<Backend> backend_;
    DeviceArena arena_;  // after backend_, which it uses
    expcache_config_t config_ = {};
    uint32_t log_level_ = EXPCACHE_LOG_NOTICE;
    expcache_log_fn log_fn_ = nullptr;
    void* log_user_ = nullptr;
    expcache_memory_dropped_fn dropped_fn_ = nullptr;
    void* dropped_user_ = nullptr;
    bool poisoned_ = false;
    uint64_t call_ = 0;
    PolicyClock clock_;
    int64_t last_layer_ = -1;  // layer of the previous serving call
    uint32_t next_key_ = 0;
    void* last_stream_ = nullptr;
    bool have_last_stream_ = false;

    // Prefetch (serve_prefetch.cpp). The serving calls' ids: a prefetch never evicts a slot used
    // by the current or previous one, and its pieces wait for the mark recorded at the start of
    // the previous one, so every kernel reading an older slot was enqueued before them.
    std::unique_ptr<Prefetcher> prefetcher_;  // made by the first prefetch
    Prefetcher::Taken taken_;
    std::vector<PrefetchJob> partial_;  // kPrefetchPartial slots of the serving call under way
    expcache_prefetch_stats_t pstats_ = {};
    uint64_t cur_call_ = 0, prev_call_ = 0;
    int cur_mark_ = 0, prev_mark_ = 0, marks_ = 0;  // marks_: serving calls marked, up to 2
    bool copy_dirty_ = false;  // the copy stream has split misses a later call's stream must wait for
    std::vector<std::pair<int32_t, int32_t>> copy_pending_;  // (class, slot) marked copy_pending
    expcache_status_t prefetch_error_ = EXPCACHE_OK;
    std::string prefetch_message_;

    std::vector<std::unique_ptr<SourceFile>> files_;
    std::vector<LayerState> layers_;
    std::vector<ClassState> classes_;  // sized once: references to a class stay valid
    std::vector<BatchState> batches_;
    uint64_t next_batch_id_ = 1;

    uint64_t inject_copy_skip_ = 0, inject_copy_count_ = 0;

    OwnedBuffer compact_;   // load_compact's output
    OwnedBuffer overflow_;  // select's misses that got no slot

    // Per-call scratch, kept to avoid allocations on the hot path.
    std::vector<uint32_t> unique_;
    std::vector<expcache_expert_ptrs_t> ptrs_;
    std::vector<uint32_t> pending_;
    std::vector<uint8_t> resident_;  // select_split: per unique id, resident when the call began
    std::vector<ChecksumJob> checksum_jobs_;
    std::vector<std::pair<int32_t, int32_t>> inserted_;  // (class, slot) filled by the current call
};

}  // namespace expcache
