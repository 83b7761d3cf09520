#include "layers.hpp"

#include <algorithm>
#include <cstring>
#include <cstdlib>
#include <exception>
#include <memory>
#include <new>
#include <string>

#include "errors.hpp"

namespace expcache {

expcache_status_t ExpertSource::upload(Backend& backend, unsigned char* dst, const unsigned char* src, uint64_t bytes,
                                       void* stream) const {
    // An exception from the backend (setting up the staging ring: its memory, its threads)
    // becomes a failed status, so the caller frees the slot it filled.
    try {
        if (file) return backend.read_file(dst, *file, reinterpret_cast<uintptr_t>(src), bytes, stream);
        return backend.copy_h2d(dst, src, bytes, pinned(), stream);
    } catch (const std::bad_alloc&) {
        return fail(EXPCACHE_ERR_OUT_OF_HOST_MEMORY, "no host memory to set up an upload");
    } catch (const std::exception& e) {
        return fail(EXPCACHE_ERR_INTERNAL, "an upload could not be set up: %s", e.what());
    }
}

namespace {

// The calling thread's 4096-aligned buffer of at least `n` bytes for O_DIRECT reads (grown as
// needed, kept for the thread's life), or nullptr when it cannot be had.
unsigned char* direct_bounce(uint64_t n) {
    struct Freed {
        void operator()(void* p) const { std::free(p); }
    };
    thread_local std::unique_ptr<void, Freed> buf;
    thread_local uint64_t bytes = 0;
    if (bytes < n) {
        void* p = nullptr;
        const uint64_t want = (n + SourceFile::kDirectAlign - 1) / SourceFile::kDirectAlign * SourceFile::kDirectAlign;
        if (posix_memalign(&p, SourceFile::kDirectAlign, want) != 0) return nullptr;
        buf.reset(p);
        bytes = want;
    }
    return static_cast<unsigned char*>(buf.get());
}

}  // namespace

expcache_status_t ExpertSource::fill(unsigned char* dst, const unsigned char* src, uint64_t offset, uint64_t n) const {
    if (!file) {
        std::memcpy(dst, src + offset, n);  // the link reads pageable memory slowly
        return EXPCACHE_OK;
    }
    const uint64_t at = reinterpret_cast<uintptr_t>(src) + offset;
    // A file opened for O_DIRECT is read so here too (the page cache stays out of it): the
    // aligned range around the bytes into a bounce buffer, the bytes copied on from it.
    unsigned char* bounce = file->direct() ? direct_bounce(n + 2 * SourceFile::kDirectAlign) : nullptr;
    if (!bounce) return file->read(dst, at, n);
    uint64_t delta = 0;
    expcache_status_t s = file->read_direct(bounce, at, n, &delta);
    if (s == EXPCACHE_OK) std::memcpy(dst, bounce + delta, n);
    return s;
}

expcache_status_t LayerTable::validate(uint32_t layer) const {
    if (layer >= layers_.size())
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "layer %u out of range (num_layers %zu)", layer, layers_.size());
    if (!layers_[layer].registered)
        return fail(EXPCACHE_ERR_INVALID_STATE,
                    "layer %u is not registered (a dense layer, or expcache_layer_register was not called for it)",
                    layer);
    return EXPCACHE_OK;
}

expcache_status_t LayerTable::add(uint32_t layer, const expcache_layer_desc_t& d) {
    expcache_status_t s = check(layer, d);
    if (s == EXPCACHE_OK) record(layer, d);
    return s;
}

namespace {

// A descriptor's parts, from its parts array or from the three-part shorthand (num_parts 0).
struct Parts {
    int n = 0;
    bool shorthand = false;
    uint64_t bytes[kMaxParts] = {};
    uint64_t stride[kMaxParts] = {};
    const void* base[kMaxParts] = {};
    const uint64_t* offsets[kMaxParts] = {};
    const uint32_t* files[kMaxParts] = {};
    // How a message names part p ("gate", "parts[4]"), and its field ("gate_bytes", "parts[4].bytes").
    std::string name(int p) const {
        static const char* names[kThreeParts] = {"gate", "up", "down"};
        return shorthand ? std::string(names[p]) : format("parts[%d]", p);
    }
    std::string field(int p, const char* what) const { return name(p) + (shorthand ? "_" : ".") + what; }
};

bool part_is_zero(const expcache_part_t& p) {
    return p.bytes == 0 && p.stride == 0 && p.base == nullptr && p.offsets == nullptr && p.files == nullptr;
}

expcache_status_t parts_of(const expcache_layer_desc_t& d, Parts* out) {
    if (d.num_parts > EXPCACHE_MAX_PARTS)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT,
                    "num_parts must be 0 (the gate, up and down fields) or 1..%d (parts[]), got %u", EXPCACHE_MAX_PARTS,
                    d.num_parts);
    if (d.reserved != 0) return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "reserved must be 0, got %u", d.reserved);
    if (d.num_parts == 0) {
        for (const expcache_part_t& p : d.parts)
            if (!part_is_zero(p))
                return fail(EXPCACHE_ERR_INVALID_ARGUMENT,
                            "num_parts is 0 (the gate, up and down fields describe the expert) but parts[] is set: "
                            "set num_parts to the number of parts given there");
        *out = Parts{kThreeParts,
                     true,
                     {d.gate_bytes, d.up_bytes, d.down_bytes},
                     {d.gate_stride, d.up_stride, d.down_stride},
                     {d.gate_base, d.up_base, d.down_base}};
        return EXPCACHE_OK;
    }
    if (d.gate_bytes || d.up_bytes || d.down_bytes || d.gate_stride || d.up_stride || d.down_stride || d.gate_base ||
        d.up_base || d.down_base)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT,
                    "num_parts is %u (parts[] describes the expert) but a gate, up or down field is set: give the "
                    "three parts either way, not both",
                    d.num_parts);
    for (uint32_t p = d.num_parts; p < EXPCACHE_MAX_PARTS; ++p)
        if (!part_is_zero(d.parts[p]))
            return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "parts[%u] is set but num_parts is %u", p, d.num_parts);
    out->n = static_cast<int>(d.num_parts);
    for (int p = 0; p < out->n; ++p) {
        out->bytes[p] = d.parts[p].bytes;
        out->stride[p] = d.parts[p].stride;
        out->base[p] = d.parts[p].base;
        out->offsets[p] = d.parts[p].offsets;
        out->files[p] = d.parts[p].files;
    }
    return EXPCACHE_OK;
}

// Part p of a layer: its size, its stride or offsets, its files, and every expert's bytes inside
// its file (file sources) or the address space.
expcache_status_t check_part(const expcache_layer_desc_t& d, const Parts& parts, int p,
                             const std::vector<std::unique_ptr<SourceFile>>& open_files) {
    const bool from_file = d.source_kind == EXPCACHE_SOURCE_FILE;
    const std::string bytes = parts.field(p, "bytes"), stride = parts.field(p, "stride");
    const uint64_t n = parts.bytes[p];
    if (n == 0 || n > EXPCACHE_MAX_PART_BYTES_LIMIT)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "%s must be 1..2^40, got %llu", bytes.c_str(),
                    (unsigned long long)n);
    const uint64_t* offsets = parts.offsets[p];
    const uint32_t* files = parts.files[p];
    if (offsets && parts.stride[p] != 0)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "%s must be 0 with offsets (each expert has its own), got %llu",
                    stride.c_str(), (unsigned long long)parts.stride[p]);
    if (!offsets && parts.stride[p] < n)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "%s %llu is smaller than %s %llu", stride.c_str(),
                    (unsigned long long)parts.stride[p], bytes.c_str(), (unsigned long long)n);
    if (!parts.base[p] && !from_file)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "%s is NULL", parts.field(p, "base").c_str());
    if (files && !from_file)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "%s is set but source_kind is not file",
                    parts.field(p, "files").c_str());
    const uintptr_t base = reinterpret_cast<uintptr_t>(parts.base[p]);
    // Without a table the last expert ends furthest; with one, every expert is checked.
    const uint32_t first = offsets || files ? 0 : d.num_experts - 1;
    for (uint32_t e = first; e < d.num_experts; ++e) {
        const uint32_t f = files ? files[e] : d.file;
        if (files && f >= open_files.size())
            return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "%s[%u] is %u, not a file expcache_file_open gave (%zu open)",
                        parts.field(p, "files").c_str(), e, f, open_files.size());
        const unsigned __int128 end =
            (unsigned __int128)base + (offsets ? offsets[e] : (unsigned __int128)parts.stride[p] * e) + n;
        if (from_file && end > open_files[f]->size())
            return fail(EXPCACHE_ERR_INVALID_ARGUMENT,
                        "%s part of expert %u ends at byte %llu, past the end of %s (%llu bytes)",
                        parts.name(p).c_str(), e, (unsigned long long)end, open_files[f]->path().c_str(),
                        (unsigned long long)open_files[f]->size());
        if (end > (unsigned __int128)UINTPTR_MAX)
            return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "%s part of expert %u would end past the address space",
                        parts.name(p).c_str(), e);
    }
    return EXPCACHE_OK;
}

}  // namespace

expcache_status_t LayerTable::check(uint32_t layer, const expcache_layer_desc_t& d) const {
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
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "file %u was not opened with expcache_file_open (%zu open)", d.file,
                    files_.size());
    if (!from_file && d.file != 0)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "file must be 0 unless source_kind is file");
    Parts parts;
    expcache_status_t s = parts_of(d, &parts);
    if (s != EXPCACHE_OK) return s;
    for (int p = 0; p < parts.n; ++p)
        if ((s = check_part(d, parts, p, files_)) != EXPCACHE_OK) return s;
    return EXPCACHE_OK;
}

void LayerTable::record(uint32_t layer, const expcache_layer_desc_t& d) {
    const bool from_file = d.source_kind == EXPCACHE_SOURCE_FILE;
    Parts parts;
    parts_of(d, &parts);  // check() passed
    LayerState& l = layers_[layer];
    l.registered = true;
    l.source.kind = d.source_kind;
    l.source.file = from_file ? files_[d.file].get() : nullptr;
    l.num_experts = d.num_experts;
    l.nparts = parts.n;
    for (int p = 0; p < kMaxParts; ++p) {
        l.bytes[p] = parts.bytes[p];
        l.stride[p] = parts.stride[p];
        l.base[p] = static_cast<const unsigned char*>(parts.base[p]);
        l.offsets[p].clear();
        l.files[p].clear();
        if (parts.offsets[p]) l.offsets[p].assign(parts.offsets[p], parts.offsets[p] + d.num_experts);
        if (parts.files[p])
            for (uint32_t e = 0; e < d.num_experts; ++e) l.files[p].push_back(files_[parts.files[p][e]].get());
    }
    if (!keeps_keys(layer, d.num_experts)) {
        l.key_base = next_key_;
        l.key_span = d.num_experts;
        next_key_ += d.num_experts;
    }
    rank_layers();
    l.seen.assign(d.num_experts, 0);
    l.seen_pos.assign(d.num_experts, 0);
    l.slot_of.assign(d.num_experts, -1);
}

void LayerTable::unregister(uint32_t layer) {
    LayerState& l = layers_[layer];
    LayerState left;
    left.key_base = l.key_base;
    left.key_span = l.key_span;
    l = std::move(left);
    rank_layers();
}

// Layer positions for the policy clock: rank among the registered layers.
void LayerTable::rank_layers() {
    int32_t rank = 0;
    for (LayerState& other : layers_)
        if (other.registered) other.rank = rank++;
    registered_ = rank;
}

expcache_status_t LayerTable::open_file(const char* path, int fd, bool direct, uint32_t* out_file, std::string* note) {
    if (files_.size() >= 1024) return fail(EXPCACHE_ERR_INVALID_STATE, "1024 files are open already");
    std::unique_ptr<SourceFile> f(new SourceFile());
    expcache_status_t s = path ? f->open(path, direct) : f->open_fd(fd, direct);
    if (s != EXPCACHE_OK) return s;
    *note = format("source file %s: %llu bytes, %s reads", f->path().c_str(), (unsigned long long)f->size(),
                   f->direct() ? "O_DIRECT"
                   : direct    ? "buffered (O_DIRECT refused)"
                               : "buffered");
    files_.push_back(std::move(f));
    *out_file = static_cast<uint32_t>(files_.size() - 1);
    return EXPCACHE_OK;
}

size_t LayerTable::size_classes() const {
    std::vector<const uint64_t*> keys;
    for (const LayerState& l : layers_) {
        if (!l.registered) continue;
        bool seen = false;
        for (const uint64_t* k : keys) seen = seen || std::equal(k, k + kMaxParts, l.bytes);
        if (!seen) keys.push_back(l.bytes);
    }
    return keys.size();
}

}  // namespace expcache
