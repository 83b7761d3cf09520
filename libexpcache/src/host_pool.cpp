#include "host_pool.hpp"

#include <algorithm>
#include <string>

#include "errors.hpp"

namespace expcache {

uint64_t pool_layout(const uint64_t part_bytes[kMaxParts], uint64_t part_at[kMaxParts]) {
    uint64_t at = 0;
    for (int p = 0; p < kMaxParts; ++p) {
        part_at[p] = at;
        at += (part_bytes[p] + 63) / 64 * 64;
    }
    return at;
}

HostPool::HostPool(StagingRing::Transport& link, uint64_t budget_bytes, uint32_t policy)
    : link_(link), budget_(budget_bytes), policy_(budget_bytes ? make_policy(policy) : nullptr) {}

HostPool::~HostPool() {
    if (mem_) link_.free_chunk(mem_, marker_);
}

expcache_status_t HostPool::allocate() {
    if (budget_ == 0 || mem_) return EXPCACHE_OK;
    expcache_status_t s = link_.alloc_chunk(budget_, &mem_, &marker_);
    if (s != EXPCACHE_OK) {
        mem_ = nullptr;
        return fail(s, "the host pool's %llu bytes (host_budget_bytes) could not be allocated: %s",
                    (unsigned long long)budget_, std::string(last_error()).c_str());
    }
    return EXPCACHE_OK;
}

bool HostPool::note_expert(const uint64_t part_bytes[kMaxParts]) {
    uint64_t part_at[kMaxParts];
    const uint64_t bytes = pool_layout(part_bytes, part_at);
    std::lock_guard<std::mutex> lock(mu_);
    if (slot_bytes_ == 0) largest_ = std::max(largest_, bytes);
    return slot_bytes_ == 0 ? bytes <= budget_ : bytes <= slot_bytes_;
}

bool HostPool::cut() const {
    std::lock_guard<std::mutex> lock(mu_);
    return slot_bytes_ != 0;
}

uint64_t HostPool::room() const {
    std::lock_guard<std::mutex> lock(mu_);
    return slot_bytes_ ? slot_bytes_ : budget_;
}

void HostPool::cut_slots() {
    slot_bytes_ = largest_;
    const uint64_t n = slot_bytes_ ? budget_ / slot_bytes_ : 0;
    slots_.assign(n, Slot());
    policy_->resize(static_cast<int32_t>(n));
    free_.clear();
    for (uint64_t i = n; i-- > 0;) free_.push_back(static_cast<int32_t>(i));
}

void HostPool::enter(int32_t s) {
    slots_[s].state = kValid;
    policy_->on_insert(s, false, slots_[s].policy_key);
    ++resident_;
    ++counts_.inserts;
}

void HostPool::leave(int32_t s) {
    policy_->on_remove(s);
    --resident_;
}

void HostPool::release(int32_t s) {
    Slot& x = slots_[s];
    if (x.state == kValid) leave(s);
    if (x.mapped) map_.erase(x.key);
    x.mapped = false;
    x.state = kFree;
    x.pins = 0;
    free_.push_back(s);
}

bool HostPool::evictable(const void* pool, int32_t s) {
    const Slot& x = static_cast<const HostPool*>(pool)->slots_[s];
    return x.state == kValid && x.pins == 0;
}

// A free slot, else the policy's victim among the valid ones no reader holds (evicted).
int32_t HostPool::take() {
    if (free_.empty()) {
        const int32_t v = policy_->victim(evictable, this);
        if (v < 0) return -1;
        release(v);
        ++counts_.evictions;
    }
    const int32_t s = free_.back();
    free_.pop_back();
    return s;
}

void HostPool::set_clock(const PolicyClock& clock) {
    if (!policy_) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (clock.token < clock_.token || (clock.token == clock_.token && clock.pos < clock_.pos)) return;
    clock_ = clock;
    policy_->set_clock(clock);
}

HostPool::Lease HostPool::begin(uint32_t layer, uint32_t expert, uint32_t key, const uint64_t part_bytes[kMaxParts]) {
    Lease lease;
    const uint64_t bytes = pool_layout(part_bytes, lease.part_at);
    uint64_t expert_bytes = 0;
    for (int p = 0; p < kMaxParts; ++p) expert_bytes += part_bytes[p];
    std::lock_guard<std::mutex> lock(mu_);
    if (mem_ && slot_bytes_ == 0) {
        largest_ = std::max(largest_, bytes);
        cut_slots();
    }
    if (mem_ && bytes <= slot_bytes_) {
        const uint64_t id = key_of(layer, expert);
        auto it = map_.find(id);
        if (it != map_.end() && slots_[it->second].state == kValid) {
            const int32_t s = it->second;
            ++slots_[s].pins;
            policy_->on_hit(s);
            lease.slot = s;
            lease.hit = true;
            lease.at = static_cast<unsigned char*>(mem_) + uint64_t(s) * slot_bytes_;
            ++counts_.hits;
            counts_.bytes_hit += expert_bytes;
            return lease;
        }
        const int32_t s = it == map_.end() ? take() : -1;  // a fill of it under way: read past the pool
        if (s >= 0) {
            Slot& x = slots_[s];
            x.key = id;
            x.gen = gen_of(layer);
            x.policy_key = key;
            x.pins = 1;
            x.state = kFilling;
            x.mapped = true;
            map_[id] = s;
            lease.slot = s;
            lease.at = static_cast<unsigned char*>(mem_) + uint64_t(s) * slot_bytes_;
        }
    }
    if (mem_ && lease.slot < 0) ++counts_.bypassed;
    ++counts_.source_reads;
    counts_.bytes_source += expert_bytes;
    return lease;
}

void HostPool::end(const Lease& lease, bool ok) {
    if (lease.slot < 0) return;
    std::lock_guard<std::mutex> lock(mu_);
    Slot& x = slots_[lease.slot];
    if (lease.hit) {
        if (--x.pins == 0 && !x.mapped) release(lease.slot);  // forgotten while it was read
        return;
    }
    const uint32_t layer = static_cast<uint32_t>(x.key >> 32);
    if (!ok) ++counts_.failed;
    if (!ok || !x.mapped || x.gen != gen_of(layer)) {
        release(lease.slot);
        return;
    }
    x.pins = 0;
    enter(lease.slot);
}

bool HostPool::filled(Lease* lease, bool ok) {
    std::lock_guard<std::mutex> lock(mu_);
    Slot& x = slots_[lease->slot];
    if (!ok) ++counts_.failed;
    if (!ok || !x.mapped || x.gen != gen_of(static_cast<uint32_t>(x.key >> 32))) {
        release(lease->slot);
        lease->slot = -1;
        return false;
    }
    enter(lease->slot);  // pins stays 1: the filler reads it now
    lease->hit = true;
    return true;
}

void HostPool::forget_layer(uint32_t layer) {
    std::lock_guard<std::mutex> lock(mu_);
    if (gens_.size() <= layer) gens_.resize(layer + 1, 0);
    ++gens_[layer];
    for (int32_t s = 0; s < static_cast<int32_t>(slots_.size()); ++s) {
        Slot& x = slots_[s];
        if (x.state == kFree || (x.key >> 32) != layer || !x.mapped) continue;
        if (x.state == kValid && x.pins == 0) {
            release(s);
            continue;
        }
        // Read now (a hit) or being filled: out of the map, freed by its end().
        map_.erase(x.key);
        x.mapped = false;
        if (x.state == kValid) {
            leave(s);
            x.state = kFilling;  // never found again; end() of the hit frees it
        }
    }
}

void HostPool::stats(expcache_pool_stats_t* out) const {
    std::lock_guard<std::mutex> lock(mu_);
    *out = counts_;
    out->struct_size = sizeof *out;
    out->budget_bytes = budget_;
    out->slot_bytes = slot_bytes_;
    out->slots = slots_.size();
    out->resident = resident_;
}

void HostPool::reset_stats() {
    std::lock_guard<std::mutex> lock(mu_);
    counts_ = expcache_pool_stats_t{};
}

}  // namespace expcache
