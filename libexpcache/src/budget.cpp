// The budgets and the reserve changed while the cache lives (expcache_budget_set,
// expcache_reserve_set), so an engine keeps its warm cache instead of making a new one: every
// class's cap recomputed as create computes it, the shrinking classes first (the memory they give
// back serves the growing ones), each keeping its residents but for the policy's victims and its
// bank at the same address.
#include "cache.hpp"
#include "errors.hpp"

namespace expcache {

expcache_status_t Cache::set_budget(uint64_t budget_experts, uint64_t budget_bytes) {
    CallScope scope(*this);
    if (budget_experts == 0 && budget_bytes == 0)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "set budget_experts or budget_bytes (both are 0)");
    expcache_config_t next = config_;
    next.budget_experts = budget_experts;
    next.budget_bytes = budget_bytes;
    expcache_status_t s = measure_budget(&next);
    if (s == EXPCACHE_OK) s = apply_budgets(next);
    if (s == EXPCACHE_OK) free_memory_budget_ = budget_bytes == EXPCACHE_BUDGET_FREE_MEMORY;
    return s;
}

expcache_status_t Cache::set_reserve(uint64_t reserve_bytes) {
    CallScope scope(*this);
    expcache_config_t next = config_;
    next.reserve_bytes = reserve_bytes;
    if (free_memory_budget_) next.budget_bytes = EXPCACHE_BUDGET_FREE_MEMORY;  // the budget follows the reserve
    expcache_status_t s = measure_budget(&next);
    return s == EXPCACHE_OK ? apply_budgets(next) : s;
}

expcache_status_t Cache::measure_budget(expcache_config_t* cfg) {
    if (cfg->budget_bytes != EXPCACHE_BUDGET_FREE_MEMORY) return EXPCACHE_OK;
    uint64_t free_bytes = 0, total = 0;
    expcache_status_t s = health_.check(backend_->mem_info(&free_bytes, &total));
    if (s != EXPCACHE_OK) return s;
    const uint64_t own = classes_.slots_mapped();  // the cache's own slots: kept or given to another class
    const uint64_t room = free_bytes + own;
    if (room <= cfg->reserve_bytes)
        return fail(EXPCACHE_ERR_OUT_OF_DEVICE_MEMORY,
                    "budget_bytes is EXPCACHE_BUDGET_FREE_MEMORY, and the device's free memory (%s, %s of it this "
                    "cache's slots) is not above reserve_bytes (%s): lower the reserve, or give a budget",
                    human_bytes(room).c_str(), human_bytes(own).c_str(), human_bytes(cfg->reserve_bytes).c_str());
    cfg->budget_bytes = room - cfg->reserve_bytes;
    log_(EXPCACHE_LOG_NOTICE, "budget from free memory: %s free (%s of it this cache's slots) - reserve %s = %s",
         human_bytes(room).c_str(), human_bytes(own).c_str(), human_bytes(cfg->reserve_bytes).c_str(),
         human_bytes(cfg->budget_bytes).c_str());
    return EXPCACHE_OK;
}

expcache_status_t Cache::get_budget(uint64_t* budget_experts, uint64_t* budget_bytes, uint32_t* free_memory) const {
    CallScope scope(*this);
    *budget_experts = config_.budget_experts;
    *budget_bytes = config_.budget_bytes;
    if (free_memory) *free_memory = free_memory_budget_ ? 1 : 0;
    return EXPCACHE_OK;
}

expcache_status_t Cache::device_memory(uint64_t* free_bytes, uint64_t* total_bytes) {
    CallScope scope(*this);
    return health_.check(backend_->mem_info(free_bytes, total_bytes));
}

expcache_status_t Cache::apply_budgets(const expcache_config_t& next) {
    expcache_status_t s = health_.usable();
    if (s != EXPCACHE_OK) return s;
    const expcache_config_t before = config_;
    config_ = next;  // what the class table computes targets and caps from
    std::vector<uint64_t> caps;
    s = classes_.plan_caps(&caps);
    // A batch's slots are neither evicted nor moved: a class they hold keeps its slots.
    std::vector<bool> shrinking(caps.size(), false);
    bool shrinks = false;
    for (int32_t c = 0; c < classes_.size() && s == EXPCACHE_OK; ++c) {
        const ClassState& cls = classes_[c];
        if (!cls.in_use() || caps[c] >= cls.slots().size()) continue;
        shrinking[c] = shrinks = true;
        if (cls.busy())
            s = fail(EXPCACHE_ERR_INVALID_STATE,
                     "class %d %s would shrink from %zu to %llu slots, and unfinished prefill batches hold %llu of "
                     "its slots or stage in its batch rows: finish them (expcache_batch_finish) first",
                     c, classes_.name(cls).c_str(), cls.slots().size(), (unsigned long long)caps[c],
                     (unsigned long long)cls.held());
    }
    if (s != EXPCACHE_OK) {
        config_ = before;
        return s;
    }
    // Nothing in flight into a slot that moves or goes, and no kernel reading one.
    if (shrinks && (s = prefetch_.quiesce()) != EXPCACHE_OK) return s;
    std::vector<int32_t> dropped;  // layers whose unused prefetches were among the victims
    for (int pass = 0; pass < 2; ++pass) {
        for (int32_t c = 0; c < classes_.size(); ++c) {
            const bool shrink = shrinking[c];
            if (!classes_[c].in_use() || shrink != (pass == 0)) continue;
            uint64_t evicted = 0;
            if (shrink && (s = lookup_.shrink(c, caps[c], &evicted)) == EXPCACHE_OK && evicted > 0) {
                expcache_stats_t add = {};
                add.evictions = evicted;
                classes_.record(c, EXPCACHE_PATH_CONTROL, add);
            }
            if (s == EXPCACHE_OK) s = classes_.resize(c, caps[c], EXPCACHE_PATH_CONTROL, &dropped);
            if (s == EXPCACHE_OK && !shrink) s = lookup_.prepare(c);  // a device-lookup class's new slots
            if (s != EXPCACHE_OK) return s;
        }
    }
    for (const int32_t layer : dropped) prefetch_.dropped_unused(static_cast<uint32_t>(layer));
    log_(EXPCACHE_LOG_NOTICE, "budgets now: budget_experts %llu, budget_bytes %llu (%s), reserve %s",
         (unsigned long long)config_.budget_experts, (unsigned long long)config_.budget_bytes,
         human_bytes(config_.budget_bytes).c_str(), human_bytes(config_.reserve_bytes).c_str());
    return EXPCACHE_OK;
}

}  // namespace expcache
