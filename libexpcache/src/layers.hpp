// The model's layers as registered: where each layer's experts are (its source), their sizes,
// and per expert its slot in the layer's class. A source kind (pageable or pinned memory, a
// file) is dispatched in ExpertSource alone.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "backend/source_file.hpp"
#include "expcache.h"
#include "policy/policy.hpp"

namespace expcache {

// An expert's parts: gate, up and down in the three-part shorthand, or up to kMaxParts of any
// meaning (FP8 weights and their scales, MXFP4 blocks and scales, biases). Arrays are sized
// kMaxParts; a layer's and a class's first nparts entries are used, the rest are 0.
enum Part { kGate = 0, kUp = 1, kDown = 2, kThreeParts = 3 };
constexpr int kMaxParts = EXPCACHE_MAX_PARTS;

// Where an expert's bytes come from and how they move: a source kind in one place.
struct ExpertSource {
    uint32_t kind = EXPCACHE_SOURCE_PAGEABLE;
    const SourceFile* file = nullptr;  // EXPCACHE_SOURCE_FILE: addresses are offsets into it

    // Pinned memory goes to the link as it is; the others are staged.
    bool pinned() const { return kind == EXPCACHE_SOURCE_PINNED; }
    // One transfer of `bytes` at `src` (an address, or a file offset) into device memory at
    // dst, enqueued on `stream` by the backend (staged ones finish by finish_uploads()).
    expcache_status_t upload(Backend& backend, unsigned char* dst, const unsigned char* src, uint64_t bytes,
                             void* stream) const;
    // `n` bytes at src + offset into host memory at dst (a prefetch's staged piece, a host pool fill);
    // a file opened for O_DIRECT is read with it (through a bounce buffer of the thread's).
    expcache_status_t fill(unsigned char* dst, const unsigned char* src, uint64_t offset, uint64_t n) const;
};

struct LayerState {
    bool registered = false;
    ExpertSource source;
    uint32_t num_experts = 0;
    int nparts = 0;
    uint64_t bytes[kMaxParts] = {};  // the class key: 0 past nparts
    uint64_t stride[kMaxParts] = {};
    const unsigned char* base[kMaxParts] = {};
    std::vector<uint64_t> offsets[kMaxParts];         // per part, per expert (empty: base + stride * expert)
    std::vector<const SourceFile*> files[kMaxParts];  // per part, per expert (empty: source.file)
    int32_t rank = 0;                                 // position among the registered layers (the policy clock's pos)
    uint32_t key_base = 0;                            // expert e's policy key is key_base + e
    uint32_t key_span = 0;  // the keys from key_base the layer was given (kept when it is unregistered)
    int32_t cls = -1;       // bound class index, valid while the class's gen == cls_gen
    uint64_t cls_gen = 0;
    uint32_t prefetched = 0;         // experts prefetched since the layer's last serving call (the limit)
    std::vector<int32_t> slot_of;    // per expert: slot index or -1
    std::vector<uint64_t> seen;      // per expert: last call that listed it (dedupe without clearing)
    std::vector<uint32_t> seen_pos;  // per expert: its index in that call's unique list

    uint64_t expert_bytes() const {
        uint64_t n = 0;
        for (int p = 0; p < nparts; ++p) n += bytes[p];
        return n;
    }
    // Whether a device select feeds this layer's misses (kernels/feed_protocol.hpp): its source is
    // not pinned memory the GPU maps, or a part has per-expert offsets or files, which the kernel's
    // copy (base + stride * expert) cannot address.
    bool fed() const {
        if (!source.pinned()) return true;
        for (int p = 0; p < nparts; ++p)
            if (!offsets[p].empty() || !files[p].empty()) return true;
        return false;
    }
    // Where part p of `expert` is (an address, or an offset into source_of(p, expert).file).
    const unsigned char* source_at(int part, uint32_t expert) const {
        return base[part] + (offsets[part].empty() ? stride[part] * expert : offsets[part][expert]);
    }
    // The source part p of `expert` is read from: the layer's, with that expert's file.
    ExpertSource source_of(int part, uint32_t expert) const {
        ExpertSource s = source;
        if (!files[part].empty()) s.file = files[part][expert];
        return s;
    }
};

class LayerTable {
public:
    // reuse_keys: a layer registered again takes the keys it had when they are enough (a device
    // lookup's table is sized once); otherwise every registration takes new keys.
    LayerTable(uint32_t num_layers, bool reuse_keys) : layers_(num_layers), reuse_keys_(reuse_keys) {}

    // Checks a descriptor against the limits and the open files, then records the layer.
    expcache_status_t add(uint32_t layer, const expcache_layer_desc_t& desc);
    // add's checks alone, and its recording alone (of a descriptor check() passed).
    expcache_status_t check(uint32_t layer, const expcache_layer_desc_t& desc) const;
    void record(uint32_t layer, const expcache_layer_desc_t& desc);
    // Whether registering `layer` with num_experts experts takes the keys it had (reuse_keys).
    bool keeps_keys(uint32_t layer, uint32_t num_experts) const {
        return reuse_keys_ && layers_[layer].key_span >= num_experts;
    }
    // A registered layer leaves: its source, sizes and slots are forgotten (its keys are kept for
    // keeps_keys); the others' ranks follow.
    void unregister(uint32_t layer);
    // Opens a file source, by path or (path nullptr) by the caller's descriptor `fd`; *note says
    // how it will be read (for the log).
    expcache_status_t open_file(const char* path, int fd, bool direct, uint32_t* out_file, std::string* note);
    // INVALID_ARGUMENT out of range, INVALID_STATE not registered.
    expcache_status_t validate(uint32_t layer) const;

    LayerState& operator[](size_t i) { return layers_[i]; }
    const LayerState& operator[](size_t i) const { return layers_[i]; }
    size_t size() const { return layers_.size(); }
    std::vector<LayerState>::iterator begin() { return layers_.begin(); }
    std::vector<LayerState>::iterator end() { return layers_.end(); }
    std::vector<LayerState>::const_iterator begin() const { return layers_.begin(); }
    std::vector<LayerState>::const_iterator end() const { return layers_.end(); }
    int32_t registered() const { return registered_; }
    // The policy clock of a serving call of registered layer `layer` at `token`: pos the layer's
    // rank among the registered layers, positions their number. A host-side call's
    // (CallClock::open_serving), and a device select's where the host times its uses (the feed's
    // of the host pool).
    PolicyClock clock_at(uint32_t layer, int32_t token) const {
        return PolicyClock{token, layers_[layer].rank, registered_};
    }
    // Distinct part sizes among the registered layers: the classes the layout needs.
    size_t size_classes() const;

private:
    void rank_layers();

    std::vector<LayerState> layers_;
    std::vector<std::unique_ptr<SourceFile>> files_;
    const bool reuse_keys_;
    uint32_t next_key_ = 0;
    int32_t registered_ = 0;
};

}  // namespace expcache
