#include "source_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "../errors.hpp"

namespace expcache {

SourceFile::~SourceFile() {
    if (fd_ >= 0) ::close(fd_);
    if (direct_fd_ >= 0) ::close(direct_fd_);
}

expcache_status_t SourceFile::open(const std::string& path) {
    path_ = path;
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) return fail(EXPCACHE_ERR_IO, "cannot open %s: %s", path.c_str(), std::strerror(errno));
    struct stat st;
    if (fstat(fd_, &st) != 0) return fail(EXPCACHE_ERR_IO, "cannot stat %s: %s", path.c_str(), std::strerror(errno));
    if (!S_ISREG(st.st_mode)) return fail(EXPCACHE_ERR_IO, "%s is not a regular file", path.c_str());
    size_ = static_cast<uint64_t>(st.st_size);
#ifdef O_DIRECT
    direct_fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);  // tmpfs and others refuse: fine
#endif
    return EXPCACHE_OK;
}

expcache_status_t SourceFile::read(void* dst, uint64_t offset, uint64_t n) const {
    char* out = static_cast<char*>(dst);
    while (n > 0) {
        ssize_t got = ::pread(fd_, out, n, static_cast<off_t>(offset));
        if (got < 0) {
            if (errno == EINTR) continue;
            return fail(EXPCACHE_ERR_IO, "reading %s at %llu: %s", path_.c_str(), (unsigned long long)offset,
                        std::strerror(errno));
        }
        if (got == 0)
            return fail(EXPCACHE_ERR_IO, "reading %s at %llu: the file ended early (is it shorter than registered?)",
                        path_.c_str(), (unsigned long long)offset);
        out += got;
        offset += static_cast<uint64_t>(got);
        n -= static_cast<uint64_t>(got);
    }
    return EXPCACHE_OK;
}

expcache_status_t SourceFile::read_aligned(void* dst, uint64_t offset, uint64_t n) const {
    if (direct_fd_ >= 0) {
        char* out = static_cast<char*>(dst);
        uint64_t left = n, at = offset;
        while (left > 0) {
            ssize_t got = ::pread(direct_fd_, out, left, static_cast<off_t>(at));
            if (got < 0 && errno == EINTR) continue;
            if (got <= 0) break;  // refused or short at the end of the file: finish buffered
            out += got;
            at += static_cast<uint64_t>(got);
            left -= static_cast<uint64_t>(got);
        }
        if (left == 0) return EXPCACHE_OK;
        uint64_t done = n - left;
        uint64_t tail = at >= size_ ? 0 : (size_ - at < left ? size_ - at : left);
        return read(static_cast<char*>(dst) + done, at, tail);
    }
    uint64_t end = offset + n < size_ ? offset + n : size_;
    return read(dst, offset, end - offset);
}

}  // namespace expcache
