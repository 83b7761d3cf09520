// A file that expert bytes are read from (EXPCACHE_SOURCE_FILE). Reads use
// pread, through the page cache by default; opened `direct`, aligned ranges
// bypass it with O_DIRECT where the file system accepts it (a model larger
// than RAM would only thrash the page cache), and anything the direct
// descriptor refuses falls back to the buffered one.
#pragma once

#include <cstdint>
#include <string>

#include "expcache.h"

namespace expcache {

class SourceFile {
public:
    static constexpr uint64_t kDirectAlign = 4096;

    ~SourceFile();
    // Status: OK, IO.
    expcache_status_t open(const std::string& path, bool direct);
    // The file behind the caller's descriptor `fd`, through a duplicate of its own (the caller may
    // close fd at once); O_DIRECT reads through /proc/self/fd where the system has it. Status:
    // OK, INVALID_ARGUMENT (fd is no open descriptor), IO.
    expcache_status_t open_fd(int fd, bool direct);
    uint64_t size() const { return size_; }
    const std::string& path() const { return path_; }
    bool direct() const { return direct_fd_ >= 0; }

    // Read exactly n bytes at offset into dst through the buffered descriptor.
    expcache_status_t read(void* dst, uint64_t offset, uint64_t n) const;
    // Read [offset, offset + n) through O_DIRECT: the 4096-aligned range around it
    // goes to the 4096-aligned dst (room for n + 2 * kDirectAlign bytes) and the part
    // starts at dst + *delta. What O_DIRECT refuses or leaves short is read buffered.
    expcache_status_t read_direct(void* dst, uint64_t offset, uint64_t n, uint64_t* delta) const;

private:
    std::string path_;
    int fd_ = -1;
    int direct_fd_ = -1;
    uint64_t size_ = 0;
};

}  // namespace expcache
