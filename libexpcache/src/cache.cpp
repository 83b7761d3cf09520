#include "cache.hpp"

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <strings.h>
#include <exception>
#include <new>

#include "errors.hpp"

namespace expcache {

namespace {

constexpr uint64_t kAlign = 256;
constexpr uint64_t kGiB = uint64_t(1) << 30;
constexpr uint64_t kMaxPartBytes = uint64_t(1) << 40;
constexpr uint64_t kMaxBatchIds = uint64_t(1) << 26;
constexpr uint32_t kMaxCompact = 1u << 20;
constexpr const char* kPathNames[EXPCACHE_NUM_PATHS] = {"decode", "compact", "batch", "control"};

uint64_t align_up(uint64_t v) { return (v + kAlign - 1) & ~(kAlign - 1); }

// Bytes as GiB, or MiB below 1 GiB (the host backend's emulated devices are small).
std::string human_bytes(uint64_t n) {
    if (n >= kGiB) return format("%.2f GiB", double(n) / double(kGiB));
    return format("%.1f MiB", double(n) / double(uint64_t(1) << 20));
}

// An on/off environment value: 1 for 1/true/yes/on, 0 for 0/false/no/off (any case), -1 otherwise.
int parse_switch(const char* text) {
    static const char* const kOn[] = {"1", "true", "yes", "on"};
    static const char* const kOff[] = {"0", "false", "no", "off"};
    for (const char* w : kOn)
        if (strcasecmp(text, w) == 0) return 1;
    for (const char* w : kOff)
        if (strcasecmp(text, w) == 0) return 0;
    return -1;
}

bool slot_evictable(const void* ctx, int32_t s) {
    // ctx points at {slots, current call}; see acquire_slot.
    auto* c = static_cast<const std::pair<const std::vector<SlotState>*, uint64_t>*>(ctx);
    const SlotState& slot = (*c->first)[static_cast<size_t>(s)];
    return slot.holds == 0 && slot.last_call != c->second;
}

}  // namespace

// Serializes a call and makes the backend's device current for its length.
class Cache::CallScope {
public:
    explicit CallScope(const Cache& c) : lock_(c.mu_), backend_(*c.backend_) { backend_.enter(); }
    ~CallScope() { backend_.leave(); }

private:
    std::lock_guard<std::mutex> lock_;
    Backend& backend_;
};

// A call's uploads from pageable and file sources may still be running on the
// backend's staging threads; all are enqueued on the stream before the call
// returns. If one failed, the slots the call filled hold wrong bytes: they are
// made free again and the call fails, so a later hit never serves them.
class Cache::UploadScope {
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
    void abandon() {
        if (settled_) return;
        settled_ = true;
        std::string why = last_error();
        if (c_.settle_uploads() != EXPCACHE_OK) {
            std::string also = last_error();
            // Only the message is set here: the call returns its own status.
            fail(EXPCACHE_ERR_IO, "%s (an upload issued earlier in the call failed too: %s)", why.c_str(),
                 also.c_str());
        }
    }

private:
    Cache& c_;
    bool settled_ = false;
};

// ---------------------------------------------------------------------------
// Lifetime

expcache_status_t Cache::create(const expcache_config_t& config, std::unique_ptr<Cache>* out) {
    expcache_config_t cfg = config;
    if (cfg.num_layers == 0 || cfg.num_layers > EXPCACHE_MAX_LAYERS_LIMIT)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "num_layers must be 1..%u, got %u", EXPCACHE_MAX_LAYERS_LIMIT,
                    cfg.num_layers);
    if (cfg.max_classes == 0 || cfg.max_classes > EXPCACHE_MAX_CLASSES_LIMIT)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "max_classes must be 1..%u, got %u",
                    EXPCACHE_MAX_CLASSES_LIMIT, cfg.max_classes);
    if (cfg.backend > EXPCACHE_BACKEND_CUDA)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "unknown backend %u (0 auto, 1 host, 2 cuda)", cfg.backend);
    if (cfg.log_level > EXPCACHE_LOG_DEBUG)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "log_level must be 0..3, got %u", cfg.log_level);
    if (cfg.budget_experts == 0 && cfg.budget_bytes == 0)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "set budget_experts or budget_bytes (both are 0)");
    if (cfg.device_capacity_bytes == 0)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "device_capacity_bytes must be > 0");
    if (cfg.slab_bytes == 0) return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "slab_bytes must be > 0");
    if (cfg.copy_threads > 64) return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "copy_threads must be 0..64, got %u", cfg.copy_threads);
    if (cfg.policy > EXPCACHE_POLICY_OPPCLASS)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "unknown policy %u (0 lru, 1 oppclass)", cfg.policy);
    if (cfg.staging_bytes < (uint64_t(1) << 20) || cfg.staging_bytes > (uint64_t(16) << 30))
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "staging_bytes must be 1 MiB..16 GiB, got %llu",
                    (unsigned long long)cfg.staging_bytes);
    if (cfg.staging_chunk_bytes < (uint64_t(64) << 10) || cfg.staging_chunk_bytes > (uint64_t(64) << 20) ||
        cfg.staging_chunk_bytes % 4096 != 0)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT,
                    "staging_chunk_bytes must be a multiple of 4096 in 64 KiB..64 MiB, got %llu",
                    (unsigned long long)cfg.staging_chunk_bytes);
    if (cfg.file_reads > EXPCACHE_FILE_READS_DIRECT)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "unknown file_reads %u (0 buffered, 1 direct)", cfg.file_reads);
    if (const char* env = std::getenv("EXPCACHE_RESERVE_GB")) {
        char* end = nullptr;
        double gb = std::strtod(env, &end);
        if (end == env || *end != '\0' || !std::isfinite(gb) || gb < 0 || gb > 1e6)
            return fail(EXPCACHE_ERR_INVALID_ARGUMENT,
                        "EXPCACHE_RESERVE_GB=\"%s\" is not a number of GiB between 0 and 1e6", env);
        cfg.reserve_bytes = static_cast<uint64_t>(gb * double(kGiB));
    }
    if (const char* env = std::getenv("EXPCACHE_VERBOSE")) {
        int on = parse_switch(env);
        if (on < 0)
            return fail(EXPCACHE_ERR_INVALID_ARGUMENT,
                        "EXPCACHE_VERBOSE=\"%s\" is not one of 1, true, yes, on (verbose) or 0, false, no, off", env);
        if (on) cfg.log_level = EXPCACHE_LOG_DEBUG;
    }

    std::unique_ptr<Cache> c(new Cache());
    c->config_ = cfg;
    c->log_level_ = cfg.log_level;
    const StagingConfig staging{cfg.copy_threads, cfg.staging_bytes, cfg.staging_chunk_bytes};
    if (cfg.backend == EXPCACHE_BACKEND_HOST) {
        c->backend_ = make_host_backend(cfg.device_capacity_bytes, staging);
    } else {
        expcache_status_t s = make_cuda_backend(cfg.device, staging, &c->backend_);
        if (s != EXPCACHE_OK) {
            if (cfg.backend == EXPCACHE_BACKEND_CUDA) return s;
            c->backend_ = make_host_backend(cfg.device_capacity_bytes, staging);
            clear_last_error();
        }
    }
    c->layers_.resize(cfg.num_layers);
    c->classes_.resize(cfg.max_classes);
    c->batches_.reserve(EXPCACHE_MAX_BATCHES);
    *out = std::move(c);
    return EXPCACHE_OK;
}

Cache::~Cache() {
    if (!backend_) return;  // create() failed before a backend existed
    backend_->enter();
    backend_->sync_device();
    backend_->reclaim();
    for (auto& kv : allocations_) backend_->free_now(reinterpret_cast<void*>(kv.first));
    allocations_.clear();
    backend_->leave();
}

// ---------------------------------------------------------------------------
// Helpers

void Cache::log(uint32_t level, const char* fmt, ...) {
    if (level > log_level_) return;
    va_list ap;
    va_start(ap, fmt);
    std::string msg = vformat(fmt, ap);
    va_end(ap);
    if (log_fn_) log_fn_(log_user_, level, msg.c_str());
    else std::fprintf(stderr, "expcache: %s\n", msg.c_str());
}

expcache_status_t Cache::check(expcache_status_t s) {
    if (s == EXPCACHE_ERR_POISONED) poisoned_ = true;
    return s;
}

expcache_status_t Cache::usable() const {
    if (poisoned_)
        return fail(EXPCACHE_ERR_POISONED,
                    "an earlier sticky CUDA error poisoned this cache; destroy it (see the first error)");
    return EXPCACHE_OK;
}

expcache_status_t Cache::validate_layer(uint32_t layer) const {
    if (layer >= layers_.size())
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "layer %u out of range (num_layers %zu)", layer, layers_.size());
    if (!layers_[layer].registered)
        return fail(EXPCACHE_ERR_INVALID_STATE, "layer %u is not registered", layer);
    return EXPCACHE_OK;
}

// The checks every serving path makes before touching anything.
expcache_status_t Cache::validate_request(uint32_t layer, const uint32_t* ids, uint64_t n, uint64_t max_n,
                                          const char* count_name) const {
    expcache_status_t s = usable();
    if (s == EXPCACHE_OK) s = validate_layer(layer);
    if (s != EXPCACHE_OK) return s;
    if (n == 0 || n > max_n)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "%s must be 1..%llu, got %llu", count_name,
                    (unsigned long long)max_n, (unsigned long long)n);
    uint32_t ne = layers_[layer].num_experts;
    for (uint64_t i = 0; i < n; ++i)
        if (ids[i] >= ne)
            return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "expert id %u (index %llu) out of range for layer %u (%u experts)",
                        ids[i], (unsigned long long)i, layer, ne);
    return EXPCACHE_OK;
}

// Order the stream, bind the layer's class and open a new call on `path`:
// advance the clock the policy sees (a call whose layer is not after the
// previous call's starts a new token).
expcache_status_t Cache::start_call(uint32_t layer, uint32_t path, void* stream, int32_t* out_cls) {
    expcache_status_t s = begin_call(stream);
    if (s == EXPCACHE_OK) s = bind(layer, path, out_cls);
    if (s != EXPCACHE_OK) return s;
    ClassState& cls = classes_[*out_cls];
    ++call_;
    cls.last_used = call_;
    cls.stats[path].calls++;
    if (last_layer_ < 0 || static_cast<int64_t>(layer) <= last_layer_) ++clock_.token;
    last_layer_ = layer;
    clock_.pos = layers_[layer].rank;
    cls.policy->set_clock(clock_);
    return EXPCACHE_OK;
}

// Every serving call starts here: finish deferred frees, and when the
// stream changes, make the new stream wait for the old one's work so that
// no slot or staging byte is overwritten while a kernel may still read it.
expcache_status_t Cache::begin_call(void* stream) {
    backend_->reclaim();
    if (have_last_stream_ && last_stream_ != stream) {
        expcache_status_t s = check(backend_->fence(last_stream_, stream));
        if (s != EXPCACHE_OK) return s;
    }
    last_stream_ = stream;
    have_last_stream_ = true;
    return EXPCACHE_OK;
}

std::string Cache::class_name(const ClassState& cls) const {
    return format("[gate %llu, up %llu, down %llu B; %.2f MiB/expert]", (unsigned long long)cls.key[kGate],
                  (unsigned long long)cls.key[kUp], (unsigned long long)cls.key[kDown],
                  double(cls.key[kGate] + cls.key[kUp] + cls.key[kDown]) / double(1 << 20));
}

void Cache::dedupe(LayerState& layer, const uint32_t* ids, uint64_t n) {
    unique_.clear();
    for (uint64_t i = 0; i < n; ++i) {
        uint32_t e = ids[i];
        if (layer.seen[e] != call_) {
            layer.seen[e] = call_;
            layer.seen_pos[e] = static_cast<uint32_t>(unique_.size());
            unique_.push_back(e);
        }
    }
    ptrs_.resize(unique_.size());
}

void Cache::slot_ptrs(const ClassState& cls, const SlotState& slot, expcache_expert_ptrs_t* out) const {
    out->gate = slot.dev + cls.part_off[kGate];
    out->up = slot.dev + cls.part_off[kUp];
    out->down = slot.dev + cls.part_off[kDown];
}

// Copies the three parts, merging parts that are adjacent both in the
// source and in the destination into one transfer.
expcache_status_t Cache::copy_expert(const LayerState& layer, uint32_t expert, unsigned char* const dst[kParts],
                                     void* stream) {
    int p = 0;
    while (p < kParts) {
        const unsigned char* src = layer.source(p, expert);
        unsigned char* d = dst[p];
        uint64_t bytes = layer.bytes[p];
        int q = p + 1;
        while (q < kParts && layer.source(q, expert) == src + bytes && dst[q] == d + bytes) {
            bytes += layer.bytes[q];
            ++q;
        }
        expcache_status_t s = injected_copy_failure();
        if (s == EXPCACHE_OK) s = upload(layer, d, src, bytes, stream);
        if (s != EXPCACHE_OK) return s;
        p = q;
    }
    return EXPCACHE_OK;
}

expcache_status_t Cache::upload(const LayerState& layer, unsigned char* dst, const unsigned char* src, uint64_t bytes,
                                void* stream) {
    try {
        return check(layer.file ? backend_->read_file(dst, *layer.file, reinterpret_cast<uintptr_t>(src), bytes, stream)
                                : backend_->copy_h2d(dst, src, bytes, layer.pinned, stream));
    } catch (const std::bad_alloc&) {
        return fail(EXPCACHE_ERR_OUT_OF_HOST_MEMORY, "no host memory to set up an upload");
    } catch (const std::exception& e) {
        return fail(EXPCACHE_ERR_INTERNAL, "an upload could not be set up: %s", e.what());
    }
}

expcache_status_t Cache::injected_copy_failure() {
    if (inject_copy_count_ == 0) return EXPCACHE_OK;
    if (inject_copy_skip_ > 0) {
        --inject_copy_skip_;
        return EXPCACHE_OK;
    }
    --inject_copy_count_;
    return fail(EXPCACHE_ERR_CUDA, "injected copy failure");
}

// ---------------------------------------------------------------------------
// Device memory

expcache_status_t Cache::alloc_device(uint64_t bytes, void** out) {
    if (inject_count_ > 0) {
        if (inject_skip_ > 0) {
            --inject_skip_;
        } else {
            --inject_count_;
            return fail(EXPCACHE_ERR_OUT_OF_DEVICE_MEMORY, "injected device allocation failure (%llu bytes)",
                        (unsigned long long)bytes);
        }
    }
    void* p = nullptr;
    expcache_status_t s = check(backend_->alloc(bytes, &p));
    if (s != EXPCACHE_OK) return s;
    allocations_[reinterpret_cast<uintptr_t>(p)] = bytes;
    device_bytes_ += bytes;
    *out = p;
    return EXPCACHE_OK;
}

void Cache::free_device_now(void* ptr) {
    auto it = allocations_.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == allocations_.end()) return;
    device_bytes_ -= it->second;
    allocations_.erase(it);
    backend_->free_now(ptr);
}

expcache_status_t Cache::free_device_after(void* ptr, void* stream) {
    auto it = allocations_.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == allocations_.end()) return EXPCACHE_OK;
    expcache_status_t s = check(backend_->free_after(ptr, stream));
    if (s != EXPCACHE_OK) return s;
    device_bytes_ -= it->second;
    allocations_.erase(it);
    return EXPCACHE_OK;
}

bool Cache::owns_range(const void* ptr, uint64_t bytes) const {
    uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
    auto it = allocations_.upper_bound(p);
    if (it == allocations_.begin()) return false;
    --it;
    return p >= it->first && bytes <= it->second && p - it->first <= it->second - bytes;
}

// Staging is tried first; only when device memory is really short are the
// expert caches released (all classes not holding batch slots) and the
// allocation retried, exactly once.
expcache_status_t Cache::alloc_staging(uint64_t bytes, int32_t c, uint32_t path, void** out) {
    expcache_status_t s = alloc_device(bytes, out);
    if (s != EXPCACHE_ERR_OUT_OF_DEVICE_MEMORY) return s;
    std::string first = last_error();
    s = release_unheld(path);
    if (s != EXPCACHE_OK) return s;
    classes_[c].stats[path].alloc_retries++;
    log(EXPCACHE_LOG_NOTICE, "%s staging of %.1f MiB failed (%s); released the expert caches and retrying once",
        kPathNames[path], double(bytes) / double(1 << 20), first.c_str());
    s = alloc_device(bytes, out);
    if (s == EXPCACHE_ERR_OUT_OF_DEVICE_MEMORY)
        return fail(s, "%s staging of %llu bytes failed even after releasing the expert caches: %s",
                    kPathNames[path], (unsigned long long)bytes, last_error());
    return s;
}

// ---------------------------------------------------------------------------
// Classes, budgets and caps

void Cache::activate_class(int32_t c, const LayerState& layer) {
    ClassState& cls = classes_[c];
    cls.in_use = true;
    cls.gen++;
    uint64_t off = 0;
    for (int p = 0; p < kParts; ++p) {
        cls.key[p] = layer.bytes[p];
        cls.part_off[p] = off;
        off += align_up(layer.bytes[p]);
    }
    cls.slot_bytes = off;
    cls.policy = config_.policy == EXPCACHE_POLICY_OPPCLASS ? make_oppclass_policy() : make_lru_policy();
    cls.cap_valid = false;
    cls.cap_announced = false;
    cls.cap = cls.target = 0;
    cls.layers = 0;
}

expcache_status_t Cache::bind(uint32_t layer_index, uint32_t path, int32_t* out_cls) {
    LayerState& layer = layers_[layer_index];
    if (layer.cls >= 0 && classes_[layer.cls].in_use && classes_[layer.cls].gen == layer.cls_gen) {
        *out_cls = layer.cls;
        return EXPCACHE_OK;
    }
    int32_t found = -1, empty = -1, lru = -1;
    for (int32_t c = 0; c < static_cast<int32_t>(classes_.size()); ++c) {
        const ClassState& cls = classes_[c];
        if (!cls.in_use) {
            if (empty < 0) empty = c;
            continue;
        }
        if (std::equal(cls.key, cls.key + kParts, layer.bytes)) {
            found = c;
            break;
        }
        if (cls.held == 0 && (lru < 0 || cls.last_used < classes_[lru].last_used)) lru = c;
    }
    if (found < 0 && empty >= 0) {
        found = empty;
        activate_class(found, layer);
    } else if (found < 0) {
        if (lru < 0)
            return fail(EXPCACHE_ERR_INVALID_STATE,
                        "layer %u needs a new size class, all %zu classes are in use and every one holds "
                        "slots of an unfinished batch; finish a batch or raise max_classes",
                        layer_index, classes_.size());
        ClassState& victim = classes_[lru];
        std::string old_name = class_name(victim);
        expcache_status_t s = release_class(lru, path);
        if (s != EXPCACHE_OK) return s;
        victim.stats[path].class_reuses++;
        found = lru;
        activate_class(found, layer);
        log(EXPCACHE_LOG_NOTICE,
            "more size classes than max_classes=%zu: released class %d %s and reused it for %s (layer %u)",
            classes_.size(), lru, old_name.c_str(), class_name(classes_[found]).c_str(), layer_index);
    }
    layer.cls = found;
    layer.cls_gen = classes_[found].gen;
    layer.slot_of.assign(layer.num_experts, -1);
    classes_[found].layers++;
    *out_cls = found;
    return EXPCACHE_OK;
}

// Frees a class's slots. Every resident expert becomes non-resident; waits
// for the device first since in-flight work may still read the slots.
expcache_status_t Cache::release_class(int32_t c, uint32_t path) {
    ClassState& cls = classes_[c];
    if (cls.slabs.empty()) return EXPCACHE_OK;
    expcache_status_t s = check(backend_->sync_device());
    if (s != EXPCACHE_OK) return s;
    for (SlotState& slot : cls.slots)
        if (slot.layer >= 0) layers_[slot.layer].slot_of[slot.expert] = -1;
    for (void* slab : cls.slabs) free_device_now(slab);
    cls.slabs.clear();
    cls.slots.clear();
    cls.free_slots.clear();
    cls.policy->clear();
    cls.resident = 0;
    cls.cap_valid = false;
    cls.stats[path].releases++;
    return EXPCACHE_OK;
}

expcache_status_t Cache::release_unheld(uint32_t path) {
    uint32_t released = 0, kept = 0;
    for (int32_t c = 0; c < static_cast<int32_t>(classes_.size()); ++c) {
        if (!classes_[c].in_use || classes_[c].slabs.empty()) continue;
        if (classes_[c].held > 0) {
            ++kept;
            continue;
        }
        expcache_status_t s = release_class(c, path);
        if (s != EXPCACHE_OK) return s;
        ++released;
    }
    log(EXPCACHE_LOG_NOTICE, "released %u expert cache(s)%s", released,
        kept ? format(", kept %u holding batch slots", kept).c_str() : "");
    return EXPCACHE_OK;
}

// What the budgets ask for this class (see expcache_config_t).
uint64_t Cache::class_target(const ClassState& cls) const {
    uint64_t experts = 0;
    unsigned __int128 class_bytes = 0, total_bytes = 0;
    for (const LayerState& l : layers_) {
        if (!l.registered) continue;
        uint64_t slot = align_up(l.bytes[kGate]) + align_up(l.bytes[kUp]) + align_up(l.bytes[kDown]);
        total_bytes += (unsigned __int128)slot * l.num_experts;
        if (std::equal(cls.key, cls.key + kParts, l.bytes)) {
            experts += l.num_experts;
            class_bytes += (unsigned __int128)slot * l.num_experts;
        }
    }
    uint64_t target = experts;
    if (config_.budget_experts) target = std::min(target, config_.budget_experts);
    if (config_.budget_bytes && total_bytes > 0) {
        unsigned __int128 share = (unsigned __int128)config_.budget_bytes * class_bytes / total_bytes;
        target = std::min<uint64_t>(target, static_cast<uint64_t>(share / cls.slot_bytes));
    }
    return target;
}

void Cache::announce_cap(int32_t c, uint32_t path, const char* why) {
    ClassState& cls = classes_[c];
    cls.stats[path].cap_notices++;
    cls.cap_announced = true;
    if (cls.cap == 0 && cls.target > 0) {
        // Nothing of this class can be cached: every miss becomes a direct load. Said as a warning,
        // once per change, so that a reserve larger than free memory is never silent.
        log(EXPCACHE_LOG_WARNING,
            "class %d %s: cap 0 experts, nothing of this class will be cached (budget asks %llu)%s; "
            "lower reserve_bytes or the budget, or free device memory",
            c, class_name(cls).c_str(), (unsigned long long)cls.target, why);
        return;
    }
    log(EXPCACHE_LOG_NOTICE, "class %d %s: cap %llu experts (%.2f GiB; budget asks %llu)%s", c,
        class_name(cls).c_str(), (unsigned long long)cls.cap, double(cls.cap * cls.slot_bytes) / double(kGiB),
        (unsigned long long)cls.target, why);
}

// Runtime cap = target, limited by free device memory minus the reserve and
// minus what the other classes may still grow into. Computed when a class
// first grows and again after a release or a layout change, never on every
// call, so the cap (and its notice) changes only when something did.
expcache_status_t Cache::refresh_cap(int32_t c, uint32_t path) {
    ClassState& cls = classes_[c];
    uint64_t free_bytes = 0, total = 0;
    expcache_status_t s = check(backend_->mem_info(&free_bytes, &total));
    if (s != EXPCACHE_OK) return s;
    uint64_t others = 0;
    for (int32_t o = 0; o < static_cast<int32_t>(classes_.size()); ++o) {
        const ClassState& oc = classes_[o];
        if (o == c || !oc.in_use || !oc.cap_valid) continue;
        if (oc.cap > oc.slots.size()) others += (oc.cap - oc.slots.size()) * oc.slot_bytes;
    }
    uint64_t needed = config_.reserve_bytes + others;
    uint64_t avail = free_bytes > needed ? free_bytes - needed : 0;
    uint64_t mem_cap = cls.slots.size() + avail / cls.slot_bytes;
    uint64_t old_cap = cls.cap;
    cls.target = class_target(cls);
    cls.cap = std::min(cls.target, mem_cap);
    cls.cap_valid = true;
    if (!cls.cap_announced || cls.cap != old_cap) {
        std::string why;
        if (cls.cap < cls.target)
            why = format(", limited by free device memory minus the reserve (%s free, reserve %s)",
                         human_bytes(free_bytes).c_str(), human_bytes(config_.reserve_bytes).c_str());
        announce_cap(c, path, why.c_str());
    }
    return EXPCACHE_OK;
}

expcache_status_t Cache::grow(int32_t c, uint32_t path) {
    ClassState& cls = classes_[c];
    uint64_t have = cls.slots.size();
    uint64_t per_slab = std::max<uint64_t>(1, config_.slab_bytes / cls.slot_bytes);
    uint64_t n = std::min(cls.cap - have, per_slab);
    void* slab = nullptr;
    expcache_status_t s = alloc_device(n * cls.slot_bytes, &slab);
    if (s == EXPCACHE_ERR_OUT_OF_DEVICE_MEMORY) {
        // Memory is shorter than the cap assumed: stop growing here.
        cls.cap = have;
        announce_cap(c, path, format(", a slot allocation failed: %s", last_error()).c_str());
        clear_last_error();
        return EXPCACHE_OK;
    }
    if (s != EXPCACHE_OK) return s;
    cls.slabs.push_back(slab);
    cls.slots.resize(have + n);
    cls.policy->resize(static_cast<int32_t>(have + n));
    for (uint64_t i = 0; i < n; ++i) cls.slots[have + i].dev = static_cast<unsigned char*>(slab) + i * cls.slot_bytes;
    for (uint64_t i = n; i-- > 0;) cls.free_slots.push_back(static_cast<int32_t>(have + i));
    return EXPCACHE_OK;
}

void Cache::evict(int32_t c, int32_t s, uint32_t path) {
    ClassState& cls = classes_[c];
    SlotState& slot = cls.slots[s];
    layers_[slot.layer].slot_of[slot.expert] = -1;
    cls.policy->on_remove(s);
    slot.layer = -1;
    cls.resident--;
    cls.stats[path].evictions++;
}

// A slot filled by this call whose upload failed: free again, never served.
void Cache::uninstall(int32_t c, int32_t s) {
    ClassState& cls = classes_[c];
    SlotState& slot = cls.slots[s];
    if (slot.layer < 0) return;
    layers_[slot.layer].slot_of[slot.expert] = -1;
    cls.policy->on_remove(s);
    slot.layer = -1;
    cls.resident--;
    cls.free_slots.push_back(s);
}

expcache_status_t Cache::settle_uploads() {
    expcache_status_t s = check(backend_->finish_uploads());
    if (s != EXPCACHE_OK)
        for (const auto& cs : inserted_) uninstall(cs.first, cs.second);
    inserted_.clear();
    return s;
}

// A slot for a miss: a free one, else a new one within the cap, else (if
// allowed) the policy's victim among slots neither used by this call nor
// held by a batch. *out = -1 when none may be had.
expcache_status_t Cache::acquire_slot(int32_t c, bool allow_grow, bool allow_evict, uint32_t path, int32_t* out) {
    ClassState& cls = classes_[c];
    if (cls.free_slots.empty() && allow_grow) {
        if (!cls.cap_valid) {
            expcache_status_t s = refresh_cap(c, path);
            if (s != EXPCACHE_OK) return s;
        }
        if (cls.slots.size() < cls.cap) {
            expcache_status_t s = grow(c, path);
            if (s != EXPCACHE_OK) return s;
        }
    }
    if (!cls.free_slots.empty()) {
        *out = cls.free_slots.back();
        cls.free_slots.pop_back();
        return EXPCACHE_OK;
    }
    *out = -1;
    if (allow_evict) {
        std::pair<const std::vector<SlotState>*, uint64_t> ctx(&cls.slots, call_);
        int32_t v = cls.policy->victim(slot_evictable, &ctx);
        if (v >= 0) {
            evict(c, v, path);
            *out = v;
        }
    }
    return EXPCACHE_OK;
}

// ---------------------------------------------------------------------------
// Layout

expcache_status_t Cache::register_layer(uint32_t layer, const expcache_layer_desc_t& d) {
    CallScope scope(*this);
    if (layer >= layers_.size())
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "layer %u out of range (num_layers %zu)", layer, layers_.size());
    if (layers_[layer].registered) return fail(EXPCACHE_ERR_INVALID_STATE, "layer %u is already registered", layer);
    if (d.num_experts == 0 || d.num_experts > EXPCACHE_MAX_EXPERTS_LIMIT)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "num_experts must be 1..%u, got %u", EXPCACHE_MAX_EXPERTS_LIMIT,
                    d.num_experts);
    if (d.source_kind > EXPCACHE_SOURCE_FILE)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "unknown source_kind %u (0 pageable, 1 pinned, 2 file)",
                    d.source_kind);
    const bool from_file = d.source_kind == EXPCACHE_SOURCE_FILE;
    if (from_file && d.file >= files_.size())
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "file %u was not opened with expcache_open_file (%zu open)", d.file,
                    files_.size());
    if (!from_file && d.file != 0) return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "file must be 0 unless source_kind is file");
    const uint64_t bytes[kParts] = {d.gate_bytes, d.up_bytes, d.down_bytes};
    const uint64_t stride[kParts] = {d.gate_stride, d.up_stride, d.down_stride};
    const void* base[kParts] = {d.gate_base, d.up_base, d.down_base};
    static const char* names[kParts] = {"gate", "up", "down"};
    for (int p = 0; p < kParts; ++p) {
        if (bytes[p] == 0 || bytes[p] > kMaxPartBytes)
            return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "%s_bytes must be 1..2^40, got %llu", names[p],
                        (unsigned long long)bytes[p]);
        if (stride[p] < bytes[p])
            return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "%s_stride %llu is smaller than %s_bytes %llu", names[p],
                        (unsigned long long)stride[p], names[p], (unsigned long long)bytes[p]);
        if (!base[p] && !from_file) return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "%s_base is NULL", names[p]);
        unsigned __int128 end = (unsigned __int128)reinterpret_cast<uintptr_t>(base[p]) +
                                (unsigned __int128)stride[p] * (d.num_experts - 1) + bytes[p];
        if (from_file && end > files_[d.file]->size())
            return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "%s part of the last expert ends at byte %llu, past the end of %s "
                        "(%llu bytes)", names[p], (unsigned long long)end, files_[d.file]->path().c_str(),
                        (unsigned long long)files_[d.file]->size());
        if (end > (unsigned __int128)UINTPTR_MAX)
            return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "%s part of the last expert would end past the address space",
                        names[p]);
    }
    LayerState& l = layers_[layer];
    l.registered = true;
    l.pinned = d.source_kind == EXPCACHE_SOURCE_PINNED;
    l.file = from_file ? files_[d.file].get() : nullptr;
    l.num_experts = d.num_experts;
    for (int p = 0; p < kParts; ++p) {
        l.bytes[p] = bytes[p];
        l.stride[p] = stride[p];
        l.base[p] = static_cast<const unsigned char*>(base[p]);
    }
    l.key_base = next_key_;
    next_key_ += d.num_experts;
    // Layer positions for the policy clock: rank among the registered layers.
    int32_t rank = 0;
    for (LayerState& other : layers_)
        if (other.registered) other.rank = rank++;
    clock_.positions = rank;
    l.seen.assign(d.num_experts, 0);
    l.seen_pos.assign(d.num_experts, 0);
    l.slot_of.assign(d.num_experts, -1);
    // Budget shares depend on the whole layout: recompute caps lazily.
    for (ClassState& cls : classes_) cls.cap_valid = false;
    return EXPCACHE_OK;
}

expcache_status_t Cache::open_file(const char* path, uint32_t* out_file) {
    CallScope scope(*this);
    if (files_.size() >= 1024) return fail(EXPCACHE_ERR_INVALID_STATE, "1024 files are open already");
    std::unique_ptr<SourceFile> f(new SourceFile());
    const bool direct = config_.file_reads == EXPCACHE_FILE_READS_DIRECT;
    expcache_status_t s = f->open(path, direct);
    if (s != EXPCACHE_OK) return s;
    log(EXPCACHE_LOG_NOTICE, "source file %s: %llu bytes, %s reads", path, (unsigned long long)f->size(),
        f->direct() ? "O_DIRECT" : direct ? "buffered (O_DIRECT refused)" : "buffered");
    files_.push_back(std::move(f));
    *out_file = static_cast<uint32_t>(files_.size() - 1);
    return EXPCACHE_OK;
}

// ---------------------------------------------------------------------------
// Decode path

expcache_status_t Cache::select(uint32_t layer_index, const uint32_t* ids, uint32_t k, void* stream,
                                expcache_expert_ptrs_t* out) {
    CallScope scope(*this);
    UploadScope uploads(*this);
    int32_t c = -1;
    expcache_status_t s = validate_request(layer_index, ids, k, EXPCACHE_MAX_SELECT, "k");
    if (s == EXPCACHE_OK) s = start_call(layer_index, EXPCACHE_PATH_DECODE, stream, &c);
    if (s != EXPCACHE_OK) return s;
    LayerState& layer = layers_[layer_index];
    ClassState& cls = classes_[c];
    expcache_stats_t& st = cls.stats[EXPCACHE_PATH_DECODE];
    dedupe(layer, ids, k);

    // Hits first, so that no miss of this call can evict them.
    pending_.clear();
    for (uint32_t j = 0; j < unique_.size(); ++j) {
        int32_t slot = layer.slot_of[unique_[j]];
        if (slot < 0) {
            pending_.push_back(j);
            continue;
        }
        cls.policy->on_hit(slot);
        cls.slots[slot].last_call = call_;
        slot_ptrs(cls, cls.slots[slot], &ptrs_[j]);
        st.hits++;
    }
    uint32_t direct = 0;
    for (uint32_t j : pending_) {
        uint32_t e = unique_[j];
        st.misses++;
        int32_t slot = -1;
        uint64_t evictions_before = st.evictions;
        if ((s = acquire_slot(c, true, true, EXPCACHE_PATH_DECODE, &slot)) != EXPCACHE_OK) return s;
        if (slot < 0) {
            pending_[direct++] = j;  // compacted in place: served from staging below
            continue;
        }
        SlotState& ss = cls.slots[slot];
        unsigned char* dst[kParts] = {ss.dev + cls.part_off[kGate], ss.dev + cls.part_off[kUp],
                                      ss.dev + cls.part_off[kDown]};
        if ((s = copy_expert(layer, e, dst, stream)) != EXPCACHE_OK) {
            cls.free_slots.push_back(slot);  // never marked resident
            return s;
        }
        ss.layer = static_cast<int32_t>(layer_index);
        ss.expert = e;
        ss.last_call = call_;
        layer.slot_of[e] = slot;
        inserted_.emplace_back(c, slot);
        cls.resident++;
        cls.policy->on_insert(slot, false, layer.key_base + e);
        if (st.evictions == evictions_before) st.appends++;
        st.bytes_h2d += layer.expert_bytes();
        slot_ptrs(cls, ss, &ptrs_[j]);
    }
    if (direct > 0) {
        // The class cannot hold the whole request: serve the overflow from staging.
        uint64_t need = uint64_t(direct) * cls.slot_bytes;
        if (overflow_bytes_ < need) {
            if (overflow_ && (s = free_device_after(overflow_, stream)) != EXPCACHE_OK) return s;
            overflow_ = nullptr;
            overflow_bytes_ = 0;
            if ((s = alloc_device(need, &overflow_)) != EXPCACHE_OK) return s;
            overflow_bytes_ = need;
        }
        for (uint32_t i = 0; i < direct; ++i) {
            uint32_t j = pending_[i];
            unsigned char* base = static_cast<unsigned char*>(overflow_) + uint64_t(i) * cls.slot_bytes;
            unsigned char* dst[kParts] = {base + cls.part_off[kGate], base + cls.part_off[kUp],
                                          base + cls.part_off[kDown]};
            if ((s = copy_expert(layer, unique_[j], dst, stream)) != EXPCACHE_OK) return s;
            ptrs_[j] = {dst[kGate], dst[kUp], dst[kDown]};
            st.direct_loads++;
            st.bytes_h2d += layer.expert_bytes();
        }
    }
    if ((s = uploads.settle()) != EXPCACHE_OK) return s;
    for (uint32_t i = 0; i < k; ++i) out[i] = ptrs_[layer.seen_pos[ids[i]]];
    log(EXPCACHE_LOG_DEBUG, "select layer %u k %u: %zu unique, %zu hits, %zu misses, %u direct", layer_index, k,
        unique_.size(), unique_.size() - pending_.size(), pending_.size(), direct);
    return EXPCACHE_OK;
}

// ---------------------------------------------------------------------------
// Compact path

expcache_status_t Cache::load_compact(uint32_t layer_index, const uint32_t* ids, uint32_t n, void* stream,
                                      expcache_compact_t* out) {
    CallScope scope(*this);
    UploadScope uploads(*this);
    int32_t c = -1;
    expcache_status_t s = validate_request(layer_index, ids, n, kMaxCompact, "n");
    if (s == EXPCACHE_OK) s = start_call(layer_index, EXPCACHE_PATH_COMPACT, stream, &c);
    if (s != EXPCACHE_OK) return s;
    LayerState& layer = layers_[layer_index];
    const uint64_t* b = layer.bytes;
    uint64_t off[kParts];
    off[kGate] = 0;
    off[kUp] = align_up(off[kGate] + b[kGate] * n);
    off[kDown] = align_up(off[kUp] + b[kUp] * n);
    uint64_t total = off[kDown] + b[kDown] * n;

    // Allocate before resolving hits: the retry may release the caches.
    if (compact_bytes_ < total) {
        if (compact_ && (s = free_device_after(compact_, stream)) != EXPCACHE_OK) return s;
        compact_ = nullptr;
        compact_bytes_ = 0;
        if ((s = alloc_staging(total, c, EXPCACHE_PATH_COMPACT, &compact_)) != EXPCACHE_OK) return s;
        compact_bytes_ = total;
    }
    ClassState& cls = classes_[c];
    expcache_stats_t& st = cls.stats[EXPCACHE_PATH_COMPACT];
    dedupe(layer, ids, n);
    unsigned char* base = static_cast<unsigned char*>(compact_);
    uint32_t next_unique = 0;  // unique_ is in first-appearance order
    for (uint32_t i = 0; i < n; ++i) {
        uint32_t e = ids[i];
        bool first = layer.seen_pos[e] == next_unique;
        if (first) ++next_unique;
        unsigned char* dst[kParts] = {base + off[kGate] + b[kGate] * i, base + off[kUp] + b[kUp] * i,
                                      base + off[kDown] + b[kDown] * i};
        int32_t slot = layer.slot_of[e];
        if (slot >= 0) {
            const SlotState& ss = cls.slots[slot];
            for (int p = 0; p < kParts; ++p)
                if ((s = injected_copy_failure()) != EXPCACHE_OK ||
                    (s = check(backend_->copy_d2d(dst[p], ss.dev + cls.part_off[p], b[p], stream))) != EXPCACHE_OK)
                    return s;
            if (first) {
                cls.policy->on_hit(slot);
                st.hits++;
            }
            st.bytes_d2d += layer.expert_bytes();
        } else {
            if ((s = copy_expert(layer, e, dst, stream)) != EXPCACHE_OK) return s;
            if (first) {
                st.misses++;
                st.direct_loads++;
            }
            st.bytes_h2d += layer.expert_bytes();
        }
    }
    if ((s = uploads.settle()) != EXPCACHE_OK) return s;
    out->num_experts = n;
    out->base = compact_;
    out->bytes = total;
    out->gate_offset = off[kGate];
    out->up_offset = off[kUp];
    out->down_offset = off[kDown];
    out->gate_bytes = b[kGate];
    out->up_bytes = b[kUp];
    out->down_bytes = b[kDown];
    log(EXPCACHE_LOG_DEBUG, "load_compact layer %u n %u: %.1f MiB buffer", layer_index, n,
        double(total) / double(1 << 20));
    return EXPCACHE_OK;
}

// ---------------------------------------------------------------------------
// Batch (prefill) path

expcache_status_t Cache::batch_prepare(uint32_t layer_index, const uint32_t* ids, uint64_t n, void* stream,
                                       uint32_t* out_ids, expcache_expert_ptrs_t* out_ptrs, uint32_t* out_count,
                                       uint64_t* out_batch) {
    CallScope scope(*this);
    UploadScope uploads(*this);
    int32_t c = -1;
    expcache_status_t s = validate_request(layer_index, ids, n, kMaxBatchIds, "n");
    if (s != EXPCACHE_OK) return s;
    if (batches_.size() >= EXPCACHE_MAX_BATCHES)
        return fail(EXPCACHE_ERR_INVALID_STATE, "%d batches are unfinished; call expcache_batch_finish first",
                    EXPCACHE_MAX_BATCHES);
    if ((s = start_call(layer_index, EXPCACHE_PATH_BATCH, stream, &c)) != EXPCACHE_OK) return s;
    LayerState& layer = layers_[layer_index];
    dedupe(layer, ids, n);

    BatchState batch;
    batch.id = next_batch_id_;
    batch.cls = c;
    auto hold = [&](int32_t slot) {
        ClassState& cls = classes_[c];
        if (cls.slots[slot].holds++ == 0) cls.held++;
        batch.held.push_back(slot);
        slot_ptrs(cls, cls.slots[slot], &ptrs_[layer.seen_pos[cls.slots[slot].expert]]);
    };
    auto undo = [&]() {
        ClassState& cls = classes_[c];
        for (int32_t slot : batch.held)
            if (--cls.slots[slot].holds == 0) cls.held--;
    };
    // Hits are read in place and keep their recency.
    pending_.clear();
    for (uint32_t j = 0; j < unique_.size(); ++j) {
        int32_t slot = layer.slot_of[unique_[j]];
        if (slot < 0) pending_.push_back(j);
        else {
            classes_[c].stats[EXPCACHE_PATH_BATCH].hits++;
            hold(slot);
        }
    }
    // Misses are appended into free capacity only, as the coldest entries.
    uint32_t direct = 0;
    for (uint32_t j : pending_) {
        uint32_t e = unique_[j];
        classes_[c].stats[EXPCACHE_PATH_BATCH].misses++;
        int32_t slot = -1;
        if ((s = acquire_slot(c, true, false, EXPCACHE_PATH_BATCH, &slot)) != EXPCACHE_OK) {
            undo();
            return s;
        }
        if (slot < 0) {
            pending_[direct++] = j;
            continue;
        }
        ClassState& cls = classes_[c];
        SlotState& ss = cls.slots[slot];
        unsigned char* dst[kParts] = {ss.dev + cls.part_off[kGate], ss.dev + cls.part_off[kUp],
                                      ss.dev + cls.part_off[kDown]};
        if ((s = copy_expert(layer, e, dst, stream)) != EXPCACHE_OK) {
            cls.free_slots.push_back(slot);
            undo();
            return s;
        }
        ss.layer = static_cast<int32_t>(layer_index);
        ss.expert = e;
        ss.last_call = call_;
        layer.slot_of[e] = slot;
        inserted_.emplace_back(c, slot);
        cls.resident++;
        cls.policy->on_insert(slot, true, layer.key_base + e);
        cls.stats[EXPCACHE_PATH_BATCH].appends++;
        cls.stats[EXPCACHE_PATH_BATCH].bytes_h2d += layer.expert_bytes();
        hold(slot);
    }
    if (direct > 0) {
        // Batch staging comes out of what the caches leave free (the reserve); it never releases
        // them, so a prompt cannot flush the decode working set even when memory is short.
        uint64_t slot_bytes = classes_[c].slot_bytes;
        if ((s = alloc_device(uint64_t(direct) * slot_bytes, &batch.staging)) != EXPCACHE_OK) {
            undo();
            if (s == EXPCACHE_ERR_OUT_OF_DEVICE_MEMORY)
                return fail(s, "batch staging of %u experts (%llu bytes) does not fit next to the caches (%s); "
                            "split the batch, finish other batches, or raise reserve_bytes",
                            direct, (unsigned long long)(uint64_t(direct) * slot_bytes), last_error());
            return s;
        }
        ClassState& cls = classes_[c];
        for (uint32_t i = 0; i < direct; ++i) {
            uint32_t j = pending_[i];
            unsigned char* base = static_cast<unsigned char*>(batch.staging) + uint64_t(i) * slot_bytes;
            unsigned char* dst[kParts] = {base + cls.part_off[kGate], base + cls.part_off[kUp],
                                          base + cls.part_off[kDown]};
            if ((s = copy_expert(layer, unique_[j], dst, stream)) != EXPCACHE_OK) {
                undo();
                uploads.abandon();  // earlier uploads may still write into the staging
                free_device_after(batch.staging, stream);
                return s;
            }
            ptrs_[j] = {dst[kGate], dst[kUp], dst[kDown]};
            cls.stats[EXPCACHE_PATH_BATCH].direct_loads++;
            cls.stats[EXPCACHE_PATH_BATCH].bytes_h2d += layer.expert_bytes();
        }
    }
    if ((s = uploads.settle()) != EXPCACHE_OK) {
        undo();
        if (batch.staging) free_device_after(batch.staging, stream);
        return s;
    }
    for (uint32_t j = 0; j < unique_.size(); ++j) {
        out_ids[j] = unique_[j];
        out_ptrs[j] = ptrs_[j];
    }
    *out_count = static_cast<uint32_t>(unique_.size());
    *out_batch = batch.id;
    ++next_batch_id_;
    log(EXPCACHE_LOG_DEBUG, "batch %llu layer %u: %llu ids, %zu unique, %zu misses, %u direct",
        (unsigned long long)batch.id, layer_index, (unsigned long long)n, unique_.size(), pending_.size(), direct);
    batches_.push_back(std::move(batch));
    return EXPCACHE_OK;
}

expcache_status_t Cache::batch_finish(uint64_t id, void* stream) {
    CallScope scope(*this);
    auto it = std::find_if(batches_.begin(), batches_.end(), [&](const BatchState& b) { return b.id == id; });
    if (it == batches_.end())
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "batch %llu is unknown or already finished",
                    (unsigned long long)id);
    expcache_status_t s = usable();
    if (s == EXPCACHE_OK && it->staging) s = free_device_after(it->staging, stream);
    if (s != EXPCACHE_OK) return s;
    ClassState& cls = classes_[it->cls];
    for (int32_t slot : it->held)
        if (--cls.slots[slot].holds == 0) cls.held--;
    batches_.erase(it);
    return EXPCACHE_OK;
}

// ---------------------------------------------------------------------------
// Control and inspection

expcache_status_t Cache::release_all() {
    CallScope scope(*this);
    expcache_status_t s = usable();
    if (s == EXPCACHE_OK) s = check(backend_->sync_device());
    if (s != EXPCACHE_OK) return s;
    backend_->reclaim();
    if (compact_) free_device_now(compact_);
    if (overflow_) free_device_now(overflow_);
    compact_ = overflow_ = nullptr;
    compact_bytes_ = overflow_bytes_ = 0;
    return release_unheld(EXPCACHE_PATH_CONTROL);
}

expcache_status_t Cache::synchronize(void* stream) {
    CallScope scope(*this);
    expcache_status_t s = usable();
    if (s == EXPCACHE_OK) s = check(backend_->sync_stream(stream));
    return s;
}

expcache_status_t Cache::read_resident(uint32_t layer_index, uint32_t expert, void* dst, uint64_t dst_bytes,
                                       uint32_t* out_resident) {
    CallScope scope(*this);
    expcache_status_t s = usable();
    if (s == EXPCACHE_OK) s = validate_layer(layer_index);
    if (s != EXPCACHE_OK) return s;
    LayerState& layer = layers_[layer_index];
    if (expert >= layer.num_experts)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "expert id %u out of range for layer %u (%u experts)", expert,
                    layer_index, layer.num_experts);
    if (dst_bytes < layer.expert_bytes())
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "dst_bytes %llu < expert size %llu", (unsigned long long)dst_bytes,
                    (unsigned long long)layer.expert_bytes());
    bool bound = layer.cls >= 0 && classes_[layer.cls].in_use && classes_[layer.cls].gen == layer.cls_gen;
    int32_t slot = bound ? layer.slot_of[expert] : -1;
    if (slot < 0) {
        *out_resident = 0;
        return EXPCACHE_OK;
    }
    const ClassState& cls = classes_[layer.cls];
    unsigned char* d = static_cast<unsigned char*>(dst);
    for (int p = 0; p < kParts; ++p) {
        if ((s = check(backend_->copy_d2h_sync(d, cls.slots[slot].dev + cls.part_off[p], layer.bytes[p]))) !=
            EXPCACHE_OK)
            return s;
        d += layer.bytes[p];
    }
    *out_resident = 1;
    return EXPCACHE_OK;
}

expcache_status_t Cache::read_device(const void* src, void* dst, uint64_t n) {
    CallScope scope(*this);
    expcache_status_t s = usable();
    if (s != EXPCACHE_OK) return s;
    if (!owns_range(src, n))
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "[%p, +%llu) is not inside memory this cache allocated", src,
                    (unsigned long long)n);
    return check(backend_->copy_d2h_sync(dst, src, n));
}

// The jobs of a checksum: one per part of each expert, each inside memory this cache allocated.
expcache_status_t Cache::checksum_jobs(uint32_t layer_index, const expcache_expert_ptrs_t* ptrs, uint32_t n) {
    expcache_status_t s = usable();
    if (s == EXPCACHE_OK) s = validate_layer(layer_index);
    if (s != EXPCACHE_OK) return s;
    if (n == 0 || n > kMaxCompact) return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "n must be 1..%u, got %u", kMaxCompact, n);
    const LayerState& layer = layers_[layer_index];
    std::vector<ChecksumJob>& jobs = checksum_jobs_;
    jobs.clear();
    for (uint32_t i = 0; i < n; ++i) {
        const void* parts[kParts] = {ptrs[i].gate, ptrs[i].up, ptrs[i].down};
        for (int p = 0; p < kParts; ++p) {
            if (!owns_range(parts[p], layer.bytes[p]))
                return fail(EXPCACHE_ERR_INVALID_ARGUMENT,
                            "expert %u part %d at %p (+%llu bytes) is not inside memory this cache allocated", i, p,
                            parts[p], (unsigned long long)layer.bytes[p]);
            jobs.push_back(ChecksumJob{parts[p], layer.bytes[p], i});
        }
    }
    return EXPCACHE_OK;
}

expcache_status_t Cache::checksum(uint32_t layer_index, const expcache_expert_ptrs_t* ptrs, uint32_t n,
                                  void* stream, uint64_t* out_sums) {
    CallScope scope(*this);
    expcache_status_t s = checksum_jobs(layer_index, ptrs, n);
    if (s == EXPCACHE_OK) s = begin_call(stream);
    // Slots past the public area, so a synchronous checksum never overwrites unread async results.
    const uint32_t first = EXPCACHE_CHECKSUM_RESULTS;
    if (s == EXPCACHE_OK)
        s = check(backend_->checksum_async(checksum_jobs_.data(), static_cast<uint32_t>(checksum_jobs_.size()), n,
                                           first, stream));
    if (s == EXPCACHE_OK) s = check(backend_->sync_stream(stream));
    if (s == EXPCACHE_OK) s = check(backend_->checksum_results(first, n, out_sums));
    return s;
}

expcache_status_t Cache::checksum_async(uint32_t layer_index, const expcache_expert_ptrs_t* ptrs, uint32_t n,
                                        void* stream, uint32_t first) {
    CallScope scope(*this);
    if (uint64_t(first) + n > EXPCACHE_CHECKSUM_RESULTS)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "result slots %u..%llu are past the %d slots of the area", first,
                    (unsigned long long)first + n - 1, EXPCACHE_CHECKSUM_RESULTS);
    expcache_status_t s = checksum_jobs(layer_index, ptrs, n);
    if (s == EXPCACHE_OK) s = begin_call(stream);
    if (s == EXPCACHE_OK)
        s = check(backend_->checksum_async(checksum_jobs_.data(), static_cast<uint32_t>(checksum_jobs_.size()), n,
                                           first, stream));
    return s;
}

expcache_status_t Cache::checksum_results(uint32_t first, uint32_t n, uint64_t* out) {
    CallScope scope(*this);
    expcache_status_t s = usable();
    if (s != EXPCACHE_OK) return s;
    if (n == 0 || uint64_t(first) + n > EXPCACHE_CHECKSUM_RESULTS)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "result slots [%u, +%u) must be non-empty and within the %d slots",
                    first, n, EXPCACHE_CHECKSUM_RESULTS);
    return check(backend_->checksum_results(first, n, out));
}

expcache_status_t Cache::class_count(uint32_t* out) const {
    CallScope scope(*this);
    uint32_t n = 0;
    for (const ClassState& c : classes_) n += c.in_use ? 1 : 0;
    *out = n;
    return EXPCACHE_OK;
}

expcache_status_t Cache::class_info(uint32_t index, expcache_class_info_t* out) const {
    CallScope scope(*this);
    if (index >= classes_.size())
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "class index %u out of range (max_classes %zu)", index,
                    classes_.size());
    const ClassState& c = classes_[index];
    expcache_class_info_t info = {};
    info.struct_size = sizeof info;
    info.in_use = c.in_use;
    info.gate_bytes = c.key[kGate];
    info.up_bytes = c.key[kUp];
    info.down_bytes = c.key[kDown];
    info.slot_bytes = c.slot_bytes;
    info.target_experts = c.in_use ? class_target(c) : 0;
    info.cap_experts = c.cap;
    info.allocated_experts = c.slots.size();
    info.resident_experts = c.resident;
    info.held_experts = c.held;
    info.num_layers = c.layers;
    *out = info;
    return EXPCACHE_OK;
}

expcache_status_t Cache::layer_class(uint32_t layer, uint32_t* out) {
    CallScope scope(*this);
    expcache_status_t s = usable();
    if (s == EXPCACHE_OK) s = validate_layer(layer);
    int32_t c = -1;
    if (s == EXPCACHE_OK) s = bind(layer, EXPCACHE_PATH_CONTROL, &c);
    if (s != EXPCACHE_OK) return s;
    *out = static_cast<uint32_t>(c);
    return EXPCACHE_OK;
}

expcache_status_t Cache::get_stats(uint32_t index, uint32_t path, expcache_stats_t* out) const {
    CallScope scope(*this);
    if (index >= classes_.size())
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "class index %u out of range (max_classes %zu)", index,
                    classes_.size());
    if (path >= EXPCACHE_NUM_PATHS)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "path %u out of range (0..%d)", path, EXPCACHE_NUM_PATHS - 1);
    *out = classes_[index].stats[path];
    out->struct_size = sizeof *out;
    return EXPCACHE_OK;
}

expcache_status_t Cache::get_staging_stats(expcache_staging_stats_t* out) const {
    CallScope scope(*this);
    *out = expcache_staging_stats_t{};
    backend_->staging_stats(out);
    out->struct_size = sizeof *out;
    return EXPCACHE_OK;
}

expcache_status_t Cache::reset_stats() {
    CallScope scope(*this);
    for (ClassState& c : classes_)
        for (expcache_stats_t& st : c.stats) st = expcache_stats_t{};
    backend_->reset_staging_stats();
    return EXPCACHE_OK;
}

expcache_status_t Cache::set_log_callback(expcache_log_fn fn, void* user) {
    CallScope scope(*this);
    log_fn_ = fn;
    log_user_ = user;
    return EXPCACHE_OK;
}

expcache_status_t Cache::set_log_level(uint32_t level) {
    CallScope scope(*this);
    if (level > EXPCACHE_LOG_DEBUG) return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "log level must be 0..3, got %u", level);
    log_level_ = level;
    return EXPCACHE_OK;
}

expcache_status_t Cache::inject_alloc_failures(uint64_t skip, uint64_t count) {
    CallScope scope(*this);
    inject_skip_ = count ? skip : 0;
    inject_count_ = count;
    return EXPCACHE_OK;
}

expcache_status_t Cache::inject_copy_failures(uint64_t skip, uint64_t count) {
    CallScope scope(*this);
    inject_copy_skip_ = count ? skip : 0;
    inject_copy_count_ = count;
    return EXPCACHE_OK;
}

expcache_status_t Cache::inject_staging_failures(uint64_t skip, uint64_t count) {
    CallScope scope(*this);
    backend_->inject_staging_failures(count ? skip : 0, count);
    return EXPCACHE_OK;
}

expcache_status_t Cache::device_bytes_in_use(uint64_t* out) const {
    CallScope scope(*this);
    *out = device_bytes_;
    return EXPCACHE_OK;
}

}  // namespace expcache
