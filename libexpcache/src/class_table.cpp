#include "class_table.hpp"

#include <algorithm>

#include "errors.hpp"

namespace expcache {

std::string human_bytes(uint64_t n) {
    if (n >= kGiB) return format("%.2f GiB", double(n) / double(kGiB));
    if (n >= (uint64_t(1) << 20)) return format("%.1f MiB", double(n) / double(uint64_t(1) << 20));
    if (n >= 1024) return format("%.1f KiB", double(n) / 1024.0);
    return format("%llu B", (unsigned long long)n);
}

std::string parts_name(const uint64_t* bytes, int nparts) {
    if (nparts == kThreeParts)
        return format("gate %llu, up %llu, down %llu", (unsigned long long)bytes[kGate], (unsigned long long)bytes[kUp],
                      (unsigned long long)bytes[kDown]);
    std::string out = nparts == 1 ? "part" : "parts";
    for (int p = 0; p < nparts; ++p) out += format(p ? ", %llu" : " %llu", (unsigned long long)bytes[p]);
    return out;
}

namespace {

// What budget_bytes is shared out over (see expcache_config_t): the slot bytes of every registered
// expert, of those of one class, and how many experts that class has.
struct ClassShare {
    uint64_t experts = 0;
    unsigned __int128 class_bytes = 0, total_bytes = 0;
};

// Whether a layer of these part sizes has the class's.
bool same_sizes(const ClassState& cls, const uint64_t* bytes) {
    return std::equal(bytes, bytes + kMaxParts, cls.key_array());
}

ClassShare class_share(const LayerTable& layers, const ClassState& cls) {
    ClassShare out;
    for (const LayerState& l : layers) {
        if (!l.registered) continue;
        uint64_t slot = 0;
        for (int p = 0; p < l.nparts; ++p) slot += align_up(l.bytes[p]);
        out.total_bytes += (unsigned __int128)slot * l.num_experts;
        if (same_sizes(cls, l.bytes)) {
            out.experts += l.num_experts;
            out.class_bytes += (unsigned __int128)slot * l.num_experts;
        }
    }
    return out;
}

// EXPCACHE_PARTITION_LAYER: every layer's share of the class's `cap` slots (0 for the layers of
// other classes), the cap split over the class's registered layers in proportion to their experts,
// rounded down, the slots left over one each to the largest remainders (ties: the lower layer).
// expcache_bench.sim.driver.layer_shares is its twin.
std::vector<uint64_t> layer_shares(const LayerTable& layers, const ClassState& cls, uint64_t cap) {
    std::vector<uint64_t> shares(layers.size(), 0);
    std::vector<std::pair<uint64_t, uint32_t>> rems;  // (remainder, layer), largest first
    unsigned __int128 total = 0;
    uint64_t given = 0;
    for (uint32_t l = 0; l < layers.size(); ++l)
        if (layers[l].registered && same_sizes(cls, layers[l].bytes)) total += layers[l].num_experts;
    if (total == 0) return shares;
    for (uint32_t l = 0; l < layers.size(); ++l) {
        if (!layers[l].registered || !same_sizes(cls, layers[l].bytes)) continue;
        const unsigned __int128 scaled = (unsigned __int128)cap * layers[l].num_experts;
        shares[l] = static_cast<uint64_t>(scaled / total);
        given += shares[l];
        rems.emplace_back(static_cast<uint64_t>(scaled % total), l);
    }
    std::stable_sort(rems.begin(), rems.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    for (uint64_t i = 0; i < cap - given && i < rems.size(); ++i) ++shares[rems[i].second];
    return shares;
}

}  // namespace

ClassTable::ClassTable(const expcache_config_t& config, Backend& backend, DeviceArena& arena, LayerTable& layers,
                       Log& log, Health& health)
    : config_(config),
      backend_(backend),
      arena_(arena),
      layers_(layers),
      log_(log),
      health_(health),
      banked_(config.lookup == EXPCACHE_LOOKUP_DEVICE),
      classes_(config.max_classes) {}

void ClassTable::reset_stats() {
    for (ClassState& cls : classes_)
        for (expcache_stats_t& st : cls.stats_) st = expcache_stats_t{};
}

void ClassTable::open_call(int32_t c, uint32_t path, uint64_t call, const PolicyClock& clock) {
    ClassState& cls = classes_[c];
    cls.last_used_ = call;
    cls.stats_[path].calls++;
    cls.policy_->set_clock(clock);
}

void ClassTable::invalidate_caps() {
    for (ClassState& cls : classes_) cls.cap_valid_ = false;
}

std::string ClassTable::name(const ClassState& cls) const {
    return "[" + parts_name(cls.key_, cls.nparts_) +
           format(" B; %.2f MiB/expert]", double(cls.expert_bytes()) / double(1 << 20));
}

// Where bind() puts a layer: the class of its sizes (found), else the first free one (empty), else
// the least recently used one holding no batch slots or batch rows (lru).
void ClassTable::choose(const LayerState& layer, int32_t* found, int32_t* empty, int32_t* lru) const {
    for (int32_t c = 0; c < static_cast<int32_t>(classes_.size()); ++c) {
        const ClassState& cls = classes_[c];
        if (!cls.in_use_) {
            if (*empty < 0) *empty = c;
            continue;
        }
        if (std::equal(cls.key_, cls.key_ + kMaxParts, layer.bytes)) {
            *found = c;
            return;
        }
        if (!cls.busy() && (*lru < 0 || cls.last_used_ < classes_[*lru].last_used_)) *lru = c;
    }
}

int32_t ClassTable::bind_releases(uint32_t layer_index) const {
    const LayerState& layer = layers_[layer_index];
    if (banked_ || bound(layer) >= 0) return -1;
    int32_t found = -1, empty = -1, lru = -1;
    choose(layer, &found, &empty, &lru);
    if (found >= 0 || empty >= 0 || lru < 0 || !has_memory(classes_[lru])) return -1;
    return lru;
}

std::vector<int32_t> ClassTable::unheld() const {
    std::vector<int32_t> out;
    for (int32_t c = 0; c < static_cast<int32_t>(classes_.size()); ++c)
        if (classes_[c].in_use_ && has_memory(classes_[c]) && !classes_[c].busy()) out.push_back(c);
    return out;
}

// A layer's binding outlives its class's reuse for another layout; the generation tells.
int32_t ClassTable::bound(const LayerState& layer) const {
    if (layer.cls >= 0 && classes_[layer.cls].in_use_ && classes_[layer.cls].gen_ == layer.cls_gen) return layer.cls;
    return -1;
}

expcache_status_t ClassTable::activate(int32_t c, const LayerState& layer) {
    ClassState& cls = classes_[c];
    lay_out(cls, layer);
    // A class reused for other sizes gets a bank of its own stride (the old one goes, or stays
    // with the views that keep it).
    if (cls.bank_) arena_.free_now(cls.bank_);
    cls.bank_ = nullptr;
    cls.rows_ = 0;
    cls.forget_mappings();
    cls.slots_.clear();  // a release left them mapped when views kept the old bank
    cls.free_slots_.clear();
    // Every slot the class could ever have: each expert of its layers (those registered now: one
    // registered later shares the class's slots), so its cap can grow to them at one address.
    expcache_status_t s = reserve_rows(c, std::max<uint64_t>(1, class_share(layers_, cls).experts));
    if (s != EXPCACHE_OK) {
        cls.in_use_ = false;  // free again: the next bind starts over
        return s;
    }
    cls.in_use_ = true;
    cls.gen_++;
    cls.policy_ = make_policy(config_.policy);
    cls.cap_valid_ = false;
    cls.cap_announced_ = false;
    cls.cap_ = cls.target_ = 0;
    cls.layers_ = 0;
    return EXPCACHE_OK;
}

expcache_status_t ClassTable::bind(uint32_t layer_index, uint32_t path, int32_t* out_cls) {
    LayerState& layer = layers_[layer_index];
    const int32_t current = bound(layer);
    if (current >= 0) {
        *out_cls = current;
        return EXPCACHE_OK;
    }
    int32_t found = -1, empty = -1, lru = -1;
    choose(layer, &found, &empty, &lru);
    if (found < 0 && empty >= 0) {
        found = empty;
        expcache_status_t s = activate(found, layer);
        if (s != EXPCACHE_OK) return s;
    } else if (found < 0) {
        if (banked_)
            return fail(EXPCACHE_ERR_INVALID_STATE,
                        "layer %u needs a new size class and all %zu classes are in use; a device-lookup cache "
                        "never reuses a class (its bank's address is fixed): raise max_classes to the number of "
                        "distinct expert sizes",
                        layer_index, classes_.size());
        if (lru < 0)
            return fail(EXPCACHE_ERR_INVALID_STATE,
                        "layer %u needs a new size class, all %zu classes are in use and every one holds "
                        "slots of an unfinished batch; finish a batch or raise max_classes",
                        layer_index, classes_.size());
        ClassState& victim = classes_[lru];
        std::string old_name = name(victim);
        expcache_status_t s = release(lru, path);
        if (s != EXPCACHE_OK) return s;
        victim.stats_[path].class_reuses++;
        found = lru;
        if ((s = activate(found, layer)) != EXPCACHE_OK) return s;
        // The first reuse warns (a thrash loses every hit of both classes); later ones are notices.
        const bool first = reuses_++ == 0;
        log_(first ? EXPCACHE_LOG_WARNING : EXPCACHE_LOG_NOTICE,
             "more size classes than max_classes=%zu: released class %d %s and reused it for %s (layer %u)%s",
             classes_.size(), lru, old_name.c_str(), name(classes_[found]).c_str(), layer_index,
             first ? "; raise max_classes to the number of distinct expert sizes (later reuses are notices)" : "");
    }
    layer.cls = found;
    layer.cls_gen = classes_[found].gen_;
    layer.slot_of.assign(layer.num_experts, -1);
    classes_[found].layers_++;
    *out_cls = found;
    return banked_ ? reserve_bank(found, path) : EXPCACHE_OK;
}

// Frees a class's slots. Every resident expert becomes non-resident; the caller has vacated them
// (nothing in flight into them, the device done reading them, their unused prefetches counted).
expcache_status_t ClassTable::release(int32_t c, uint32_t path) {
    ClassState& cls = classes_[c];
    if (cls.slots_.empty()) {  // no slot (a cap of 0): only its staging rows, if any, go
        if ((cls.staging_mapped() || cls.batch_mapped()) && arena_.unmap_from(cls.bank_, 0)) cls.forget_mappings();
        return EXPCACHE_OK;
    }
    for (SlotState& slot : cls.slots_) {
        if (slot.layer_ < 0) continue;
        slot.prefetch_ = kPrefetchNone;
        layers_[slot.layer_].slot_of[slot.expert_] = -1;
    }
    cls.policy_->clear();
    cls.resident_ = 0;
    cls.stats_[path].releases++;
    // A fixed bank keeps its memory (graphs captured with its address read it), and so does one
    // that views keep (they read it): both are only emptied. Any other gives its memory back,
    // its addresses kept for its next growth.
    bool unmapped = false;
    if (!banked_) {
        if (arena_.kept(cls.bank_)) arena_.ask_to_let_go();  // views cached for reuse let go
        unmapped = arena_.unmap_from(cls.bank_, 0);
        if (!unmapped)
            log_(EXPCACHE_LOG_NOTICE, "class %s: its bank stays mapped (%s): views of it are alive", name(cls).c_str(),
                 human_bytes(cls.mapped_bytes()).c_str());
    }
    if (unmapped) {
        cls.slots_.clear();
        cls.free_slots_.clear();
        cls.forget_mappings();
        cls.cap_valid_ = false;
        return EXPCACHE_OK;
    }
    cls.free_slots_.clear();
    for (size_t i = cls.slots_.size(); i-- > 0;) {
        cls.slots_[i].layer_ = -1;
        cls.slots_[i].prefetch_ = kPrefetchNone;
        cls.free_slots_.push_back(static_cast<int32_t>(i));
    }
    return EXPCACHE_OK;
}

expcache_status_t ClassTable::release_unheld(uint32_t path) {
    uint32_t released = 0, kept = 0;
    for (int32_t c = 0; c < static_cast<int32_t>(classes_.size()); ++c) {
        if (!classes_[c].in_use_ || !has_memory(classes_[c])) continue;
        if (classes_[c].busy()) {
            ++kept;
            continue;
        }
        release(c, path);
        ++released;
    }
    log_(EXPCACHE_LOG_NOTICE, "released %u expert cache(s)%s", released,
         kept ? format(", kept %u holding batch slots", kept).c_str() : "");
    return EXPCACHE_OK;
}

// What the budgets ask for this class (see expcache_config_t).
uint64_t ClassTable::target(const ClassState& cls) const {
    const ClassShare share = class_share(layers_, cls);
    uint64_t target = share.experts;
    if (config_.budget_experts) target = std::min(target, config_.budget_experts);
    if (config_.budget_bytes && share.total_bytes > 0) {
        unsigned __int128 bytes = (unsigned __int128)config_.budget_bytes * share.class_bytes / share.total_bytes;
        target = std::min<uint64_t>(target, static_cast<uint64_t>(bytes / cls.slot_bytes_));
    }
    return target;
}

// Why the budgets give a class no expert, and the smallest budget_bytes that gives it one: its
// share, budget_bytes * class_bytes / total_bytes (rounded down), must reach one slot.
std::string ClassTable::zero_target_reason(const ClassState& cls) const {
    const ClassShare share = class_share(layers_, cls);
    if (!config_.budget_bytes || share.class_bytes == 0) return " (the budget asks 0 experts); raise the budget";
    const unsigned __int128 need =
        ((unsigned __int128)cls.slot_bytes_ * share.total_bytes + share.class_bytes - 1) / share.class_bytes;
    const std::string fix = need > UINT64_MAX
                                ? std::string("no budget_bytes can give it one (set budget_experts instead)")
                                : format("a budget_bytes of at least %llu B (%s) holds one expert of this class",
                                         (unsigned long long)need, human_bytes(static_cast<uint64_t>(need)).c_str());
    return format(": its share of budget_bytes (%llu B over all classes) is less than one expert's slot (%s); %s",
                  (unsigned long long)config_.budget_bytes, human_bytes(cls.slot_bytes_).c_str(), fix.c_str());
}

void ClassTable::announce_cap(int32_t c, uint32_t path, const char* why, const char* fix) {
    ClassState& cls = classes_[c];
    cls.stats_[path].cap_notices++;
    cls.cap_announced_ = true;
    if (cls.cap_ == 0) {
        // Nothing of this class can be cached: every miss becomes a direct load. Said as a warning,
        // once per change, with the reason and the fix, so that no way to cap 0 is silent.
        if (cls.target_ == 0) {
            log_(EXPCACHE_LOG_WARNING, "class %d %s: cap 0 experts, nothing of this class will be cached%s", c,
                 name(cls).c_str(), zero_target_reason(cls).c_str());
            return;
        }
        log_(EXPCACHE_LOG_WARNING,
             "class %d %s: cap 0 experts, nothing of this class will be cached (budget asks %llu)%s; %s", c,
             name(cls).c_str(), (unsigned long long)cls.target_, why, fix);
        return;
    }
    log_(EXPCACHE_LOG_NOTICE, "class %d %s: cap %llu experts (%.2f GiB; budget asks %llu)%s", c, name(cls).c_str(),
         (unsigned long long)cls.cap_, double(cls.cap_ * cls.slot_bytes_) / double(kGiB),
         (unsigned long long)cls.target_, why);
    if (config_.partition == EXPCACHE_PARTITION_LAYER) warn_empty_shares(c);
}

// EXPCACHE_PARTITION_LAYER: a layer whose share of the cap is 0 caches nothing (its misses are
// loaded directly, its repeats miss again): said as a warning, with the smallest cap that gives
// every layer of the class a slot.
void ClassTable::warn_empty_shares(int32_t c) const {
    const ClassState& cls = classes_[c];
    std::vector<bool> mine(layers_.size(), false);
    uint32_t layers = 0, empty = 0, first = 0;
    const std::vector<uint64_t> shares = layer_shares(layers_, cls, cls.cap_);
    for (uint32_t l = 0; l < layers_.size(); ++l) {
        mine[l] = layers_[l].registered && std::equal(cls.key_, cls.key_ + kMaxParts, layers_[l].bytes);
        if (!mine[l]) continue;
        ++layers;
        if (shares[l] == 0 && empty++ == 0) first = l;
    }
    if (empty == 0) return;
    auto every_layer_has_a_slot = [&](uint64_t cap) {
        const std::vector<uint64_t> at = layer_shares(layers_, cls, cap);
        for (uint32_t l = 0; l < layers_.size(); ++l)
            if (mine[l] && at[l] == 0) return false;
        return true;
    };
    uint64_t enough = layers;  // one slot per layer, more where the layers' expert counts differ
    while (enough < 4ull * layers && !every_layer_has_a_slot(enough)) ++enough;
    log_(EXPCACHE_LOG_WARNING,
         "class %d %s: partition layer splits its cap of %llu experts over %u layers and leaves %u of them (layer "
         "%u first) a share of 0: their misses are loaded directly and never cached; give the class a cap of at "
         "least %llu experts (a larger budget) or use partition global",
         c, name(cls).c_str(), (unsigned long long)cls.cap_, layers, empty, first, (unsigned long long)enough);
}

uint64_t ClassTable::layer_share(const ClassState& cls, uint32_t layer) const {
    return layer_shares(layers_, cls, cls.cap_)[layer];
}

// Runtime cap = target, limited by free device memory minus the reserve and
// minus what the other classes may still grow into. Computed when a class
// first grows and again after a release or a layout change, never on every
// call, so the cap (and its notice) changes only when something did.
expcache_status_t ClassTable::refresh_cap(int32_t c, uint32_t path) {
    ClassState& cls = classes_[c];
    if (banked_ && !cls.slots_.empty()) {
        cls.cap_valid_ = true;  // a bank never grows or shrinks
        return EXPCACHE_OK;
    }
    uint64_t free_bytes = 0, total = 0;
    expcache_status_t s = health_.check(backend_.mem_info(&free_bytes, &total));
    if (s != EXPCACHE_OK) return s;
    uint64_t others = 0;
    for (int32_t o = 0; o < static_cast<int32_t>(classes_.size()); ++o) {
        const ClassState& oc = classes_[o];
        if (o == c || !oc.in_use_ || !oc.cap_valid_) continue;
        if (oc.cap_ > oc.slots_.size()) others += (oc.cap_ - oc.slots_.size()) * oc.slot_bytes_;
    }
    uint64_t needed = config_.reserve_bytes + others;
    uint64_t avail = free_bytes > needed ? free_bytes - needed : 0;
    uint64_t mem_cap = cls.slots_.size() + avail / cls.slot_bytes_;
    uint64_t old_cap = cls.cap_;
    cls.target_ = target(cls);
    cls.cap_ = std::min(cls.target_, mem_cap);
    const bool bank_bound = cls.bank_ && cls.cap_ > cls.slot_rows_;
    if (bank_bound) cls.cap_ = cls.slot_rows_;
    cls.cap_valid_ = true;
    if (!cls.cap_announced_ || cls.cap_ != old_cap) {
        std::string why, fix;
        if (bank_bound)
            why = format(
                ", limited by its bank, reserved when the class was bound for the %llu experts of its layers "
                "registered then; register every layer before the first serving call",
                (unsigned long long)cls.slot_rows_);
        else if (cls.cap_ < cls.target_)
            why = format(", limited by free device memory minus the reserve (%s free, reserve %s)",
                         human_bytes(free_bytes).c_str(), human_bytes(config_.reserve_bytes).c_str());
        if (cls.cap_ == 0 && cls.target_ > 0) {
            // The largest reserve that leaves one slot: free - reserve - others >= slot_bytes.
            const std::string others_note = others
                                                ? format(" (or lower the budget: other classes may still grow into %s)",
                                                         human_bytes(others).c_str())
                                                : std::string();
            if (free_bytes >= others + cls.slot_bytes_)
                fix = format("a reserve_bytes of at most %llu B (%s) leaves room for one expert of this class%s",
                             (unsigned long long)(free_bytes - others - cls.slot_bytes_),
                             human_bytes(free_bytes - others - cls.slot_bytes_).c_str(), others_note.c_str());
            else
                fix = format("free device memory: one expert of this class needs %s%s",
                             human_bytes(cls.slot_bytes_).c_str(), others_note.c_str());
        }
        announce_cap(c, path, why.c_str(), fix.c_str());
    }
    return EXPCACHE_OK;
}

}  // namespace expcache
