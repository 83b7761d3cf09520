#include "copy_pool.hpp"

#include <cstring>

namespace expcache {

namespace {
constexpr size_t kMinPart = 256 * 1024;  // below this, threads cost more than they save
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

void CopyPool::copy_part(unsigned index) {
    size_t per = (n_ / parts_ + 63) & ~size_t(63);
    size_t begin = per * index;
    if (begin >= n_) return;
    size_t len = begin + per < n_ ? per : n_ - begin;
    std::memcpy(dst_ + begin, src_ + begin, len);
}

void CopyPool::copy(void* dst, const void* src, size_t n) {
    unsigned parts = static_cast<unsigned>(n / kMinPart);
    if (parts > threads_.size() + 1) parts = static_cast<unsigned>(threads_.size() + 1);
    if (parts <= 1) {
        std::memcpy(dst, src, n);
        return;
    }
    {
        std::lock_guard<std::mutex> lock(mu_);
        dst_ = static_cast<char*>(dst);
        src_ = static_cast<const char*>(src);
        n_ = n;
        parts_ = parts;
        pending_ = parts - 1;
        ++generation_;
    }
    start_.notify_all();
    copy_part(0);
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return pending_ == 0; });
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
        copy_part(index);
        lock.lock();
        if (--pending_ == 0) done_.notify_one();
    }
}

}  // namespace expcache
