#include "copy_pool.hpp"

#include <cstring>

#include "../errors.hpp"

namespace expcache {

namespace {
constexpr uint64_t kMinPart = 256 * 1024;  // below this, threads cost more than they save
}

CopyPool::CopyPool(unsigned threads) {
    for (unsigned i = 0; i < threads; ++i) threads_.emplace_back([this, i] { work(i + 1); });
}

CopyPool::~CopyPool() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        stop_ = true;
    }
    start_.notify_all();
    for (std::thread& t : threads_) t.join();
}

void CopyPool::copy(void* dst, const void* src, size_t n) {
    char* d = static_cast<char*>(dst);
    const char* s = static_cast<const char*>(src);
    run(n, 64, [d, s](uint64_t begin, uint64_t len) {
        std::memcpy(d + begin, s + begin, len);
        return static_cast<expcache_status_t>(EXPCACHE_OK);
    });
}

expcache_status_t CopyPool::do_part(unsigned index) {
    uint64_t begin = per_ * index;
    if (begin >= n_) return EXPCACHE_OK;
    uint64_t len = begin + per_ < n_ ? per_ : n_ - begin;
    return (*part_)(begin, len);
}

expcache_status_t CopyPool::run(uint64_t n, uint64_t grain, const Part& part) {
    uint64_t parts = n / kMinPart;
    if (parts > threads_.size() + 1) parts = threads_.size() + 1;
    if (parts <= 1) return n ? part(0, n) : EXPCACHE_OK;
    {
        std::lock_guard<std::mutex> lock(mu_);
        part_ = &part;
        n_ = n;
        per_ = (n / parts + grain - 1) / grain * grain;
        parts_ = static_cast<unsigned>(parts);
        pending_ = parts_ - 1;
        status_ = EXPCACHE_OK;
        message_.clear();
        ++generation_;
    }
    start_.notify_all();
    expcache_status_t mine = do_part(0);
    std::string mine_message = mine == EXPCACHE_OK ? std::string() : std::string(last_error());
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return pending_ == 0; });
    if (mine != EXPCACHE_OK) return fail(mine, "%s", mine_message.c_str());
    if (status_ != EXPCACHE_OK) return fail(status_, "%s", message_.c_str());  // a helper's detail, on this thread
    return EXPCACHE_OK;
}

void CopyPool::work(unsigned index) {
    unsigned long long seen = 0;
    for (;;) {
        std::unique_lock<std::mutex> lock(mu_);
        start_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        bool mine = index < parts_;
        lock.unlock();
        if (!mine) continue;
        expcache_status_t s = do_part(index);
        lock.lock();
        if (s != EXPCACHE_OK && status_ == EXPCACHE_OK) {
            status_ = s;
            message_ = last_error();
        }
        if (--pending_ == 0) done_.notify_one();
    }
}

}  // namespace expcache
