// LRU's victim (lru.hpp declares the policy) and its factory for the registry.
#include "lru.hpp"

#include <memory>

namespace expcache {

int32_t LruPolicy::victim(Evictable evictable, const void* ctx) const {
    for (int32_t s = list_.first(0); s >= 0; s = list_.next(s))
        if (evictable(ctx, s)) return s;
    return -1;
}

std::unique_ptr<Policy> make_lru_policy() {
    return std::unique_ptr<Policy>(new LruPolicy());
}

}  // namespace expcache
