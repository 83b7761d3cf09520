// The one table of eviction policies: per EXPCACHE_POLICY_* id its name and
// its factory. config.cpp validates ids and lists names from it, a class
// builds its policy through make_policy, and expcache_policy_name hands the
// names to bindings (pyexpcache builds its POLICIES from them). A new policy
// is its own file, a row here and its constant in expcache.h.
#include <memory>
#include <stdexcept>
#include <string>

#include "errors.hpp"
#include "expcache.h"
#include "policy.hpp"

namespace expcache {

std::unique_ptr<Policy> make_lru_policy();       // lru.cpp
std::unique_ptr<Policy> make_oppclass_policy();  // oppclass.cpp
std::unique_ptr<Policy> make_duel_policy();      // duel.cpp

namespace {

struct PolicyEntry {
    uint32_t id;
    const char* name;  // the lower-case tail of the id's constant
    std::unique_ptr<Policy> (*make)();
};

constexpr PolicyEntry kPolicies[] = {
    {EXPCACHE_POLICY_LRU, "lru", make_lru_policy},
    {EXPCACHE_POLICY_OPPCLASS, "oppclass", make_oppclass_policy},
    {EXPCACHE_POLICY_DUEL, "duel", make_duel_policy},
};
constexpr uint32_t kCount = sizeof kPolicies / sizeof kPolicies[0];

// Row i is id i, so an id indexes the table and bindings can list the ids from 0 until NULL.
constexpr bool rows_are_ids() {
    for (uint32_t i = 0; i < kCount; ++i)
        if (kPolicies[i].id != i) return false;
    return true;
}
static_assert(kCount == EXPCACHE_POLICY_COUNT, "a row per EXPCACHE_POLICY_* and EXPCACHE_POLICY_COUNT rows");
static_assert(rows_are_ids(), "row i of kPolicies must be EXPCACHE_POLICY_* id i");

}  // namespace

const char* policy_name(uint32_t id) {
    return id < kCount ? kPolicies[id].name : nullptr;
}

std::string policy_list() {
    std::string out;
    for (const PolicyEntry& p : kPolicies) out += format("%s%u %s", out.empty() ? "" : ", ", p.id, p.name);
    return out;
}

std::unique_ptr<Policy> make_policy(uint32_t id) {
    // config.cpp refused unknown ids at create, so this is a bug (guarded() maps it to INTERNAL).
    if (id >= kCount) throw std::logic_error(format("no policy %u (%s)", id, policy_list().c_str()));
    return kPolicies[id].make();
}

}  // namespace expcache
