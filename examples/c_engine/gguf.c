/*
 * gguf.c — the example engine's GGUF loader (gguf.h). It reads the header through a small buffered
 * pread reader, bounds-checked against the file's size, so a truncated or corrupt file is an error
 * message, never a read past the end.
 */
#define _FILE_OFFSET_BITS 64
#define _POSIX_C_SOURCE 200809L
#include "gguf.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* GGUF value types (the key-value pairs). */
enum { T_U8, T_I8, T_U16, T_I16, T_U32, T_I32, T_F32, T_BOOL, T_STRING, T_ARRAY, T_U64, T_I64, T_F64, T_COUNT };
static const uint8_t k_scalar_bytes[T_COUNT] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};

/* The ggml types an expert tensor may have here: weights per block and bytes per block (ggml's
   type traits). Enough for DeepSeek V4 Flash's GGUFs and the usual expert quantizations. */
static const struct {
    uint32_t type;
    const char* name;
    uint32_t block_weights, block_bytes;
} k_types[] = {
    {0, "F32", 1, 4},         {1, "F16", 1, 2},       {8, "Q8_0", 32, 34},    {10, "Q2_K", 256, 84},
    {11, "Q3_K", 256, 110},   {12, "Q4_K", 256, 144}, {13, "Q5_K", 256, 176}, {14, "Q6_K", 256, 210},
    {16, "IQ2_XXS", 256, 66}, {30, "BF16", 1, 2},     {39, "MXFP4", 32, 17},
};

const char* gguf_type_name(uint32_t type) {
    for (size_t i = 0; i < sizeof k_types / sizeof k_types[0]; ++i)
        if (k_types[i].type == type) return k_types[i].name;
    return "?";
}

typedef struct reader_t {
    int fd;
    uint64_t size; /* the file's bytes */
    uint64_t pos;  /* next byte to read */
    uint64_t buf_at;
    uint32_t buf_len;
    unsigned char buf[1 << 16];
    char* err;
    unsigned err_len;
} reader_t;

__attribute__((format(printf, 2, 3))) static int fail(reader_t* r, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->err, r->err_len, fmt, ap);
    va_end(ap);
    return -1;
}

static int read_bytes(reader_t* r, void* dst, uint64_t n, const char* what) {
    if (n > r->size || r->pos > r->size - n)
        return fail(r, "%s at byte %llu needs %llu bytes, but the file ends at byte %llu", what,
                    (unsigned long long)r->pos, (unsigned long long)n, (unsigned long long)r->size);
    unsigned char* out = (unsigned char*)dst;
    while (n) {
        if (r->pos < r->buf_at || r->pos >= r->buf_at + r->buf_len) {
            ssize_t got = pread(r->fd, r->buf, sizeof r->buf, (off_t)r->pos);
            if (got <= 0) return fail(r, "reading byte %llu: %s", (unsigned long long)r->pos, strerror(errno));
            r->buf_at = r->pos;
            r->buf_len = (uint32_t)got;
        }
        uint64_t at = r->pos - r->buf_at, take = r->buf_len - at;
        if (take > n) take = n;
        memcpy(out, r->buf + at, take);
        out += take;
        r->pos += take;
        n -= take;
    }
    return 0;
}

static int skip(reader_t* r, uint64_t n, const char* what) {
    if (n > r->size || r->pos > r->size - n)
        return fail(r, "%s at byte %llu claims %llu bytes, but the file ends at byte %llu", what,
                    (unsigned long long)r->pos, (unsigned long long)n, (unsigned long long)r->size);
    r->pos += n;
    return 0;
}

static int read_u32(reader_t* r, uint32_t* v, const char* what) {
    return read_bytes(r, v, 4, what);
}
static int read_u64(reader_t* r, uint64_t* v, const char* what) {
    return read_bytes(r, v, 8, what);
}

/* A GGUF string (uint64 length, bytes) into buf (NUL-terminated; `cap` bytes), or skipped when buf is NULL. */
static int read_string(reader_t* r, char* buf, uint64_t cap, const char* what) {
    uint64_t len;
    if (read_u64(r, &len, what)) return -1;
    if (!buf) return skip(r, len, what);
    if (len >= cap)
        return fail(r, "%s at byte %llu is %llu bytes long (at most %llu here)", what, (unsigned long long)r->pos,
                    (unsigned long long)len, (unsigned long long)cap - 1);
    if (read_bytes(r, buf, len, what)) return -1;
    buf[len] = 0;
    return 0;
}

/* Skip one value of `type` (arrays item by item where their items have no fixed size). */
static int skip_value(reader_t* r, uint32_t type, int depth) {
    if (type >= T_COUNT) return fail(r, "unknown value type %u at byte %llu", type, (unsigned long long)r->pos);
    if (type == T_STRING) return read_string(r, NULL, 0, "a string value");
    if (type != T_ARRAY) return skip(r, k_scalar_bytes[type], "a value");
    uint32_t item;
    uint64_t n;
    if (depth > 4) return fail(r, "arrays nested deeper than 4 at byte %llu", (unsigned long long)r->pos);
    if (read_u32(r, &item, "an array's type") || read_u64(r, &n, "an array's length")) return -1;
    if (item >= T_COUNT) return fail(r, "unknown array item type %u at byte %llu", item, (unsigned long long)r->pos);
    if (item != T_STRING && item != T_ARRAY) {
        if (n > r->size / k_scalar_bytes[item])
            return fail(r, "an array of %llu items is longer than the file", (unsigned long long)n);
        return skip(r, n * k_scalar_bytes[item], "an array");
    }
    if (n > r->size / 8) return fail(r, "an array of %llu items is longer than the file", (unsigned long long)n);
    for (uint64_t i = 0; i < n; ++i)
        if (skip_value(r, item, depth + 1)) return -1;
    return 0;
}

/* "blk.N.ffn_PART_exps.weight" -> layer N and part 0 gate, 1 up, 2 down; 3 a fused gate_up; -1 otherwise. */
static int expert_part(const char* name, uint32_t* layer) {
    if (strncmp(name, "blk.", 4) != 0) return -1;
    const char* p = name + 4;
    uint32_t n = 0;
    if (*p < '0' || *p > '9') return -1;
    for (; *p >= '0' && *p <= '9'; ++p) {
        n = n * 10 + (uint32_t)(*p - '0');
        if (n >= GGUF_MAX_LAYERS) return -1;
    }
    static const char* const parts[] = {".ffn_gate_exps.weight", ".ffn_up_exps.weight", ".ffn_down_exps.weight",
                                        ".ffn_gate_up_exps.weight"};
    for (int i = 0; i < 4; ++i)
        if (strcmp(p, parts[i]) == 0) {
            *layer = n;
            return i;
        }
    return -1;
}

typedef struct found_t {
    uint32_t parts; /* bit p: part p seen */
    gguf_moe_layer_t layer;
} found_t;

int gguf_load(int fd, gguf_model_t* out, char* err, unsigned err_len) {
    struct stat st;
    if (fstat(fd, &st) != 0) {
        snprintf(err, err_len, "fstat: %s", strerror(errno));
        return -1;
    }
    reader_t* r = (reader_t*)calloc(1, sizeof *r);
    found_t* found = (found_t*)calloc(GGUF_MAX_LAYERS, sizeof *found);
    gguf_model_t m;
    memset(&m, 0, sizeof m);
    int rc = -1;
    if (!r || !found) {
        snprintf(err, err_len, "out of memory");
        goto out;
    }
    r->fd = fd;
    r->size = (uint64_t)st.st_size;
    r->err = err;
    r->err_len = err_len;
    m.file_bytes = r->size;
    m.alignment = 32;

    char magic[4];
    if (read_bytes(r, magic, 4, "the magic")) goto out;
    if (memcmp(magic, "GGUF", 4) != 0) {
        fail(r, "not a GGUF file (its first bytes are not \"GGUF\")");
        goto out;
    }
    if (read_u32(r, &m.version, "the version")) goto out;
    if (m.version != 2 && m.version != 3) {
        fail(r, "GGUF version %u (this loader reads 2 and 3; a big-endian file reads as a huge version)", m.version);
        goto out;
    }
    if (read_u64(r, &m.num_tensors, "the tensor count") || read_u64(r, &m.num_kv, "the key-value count")) goto out;
    if (m.num_tensors > r->size / 24 || m.num_kv > r->size / 12) {
        fail(r, "%llu tensors and %llu key-value pairs cannot fit in %llu bytes", (unsigned long long)m.num_tensors,
             (unsigned long long)m.num_kv, (unsigned long long)r->size);
        goto out;
    }

    /* Key-value pairs: skipped by type, but general.alignment. */
    char key[4096];
    for (uint64_t i = 0; i < m.num_kv; ++i) {
        uint32_t type;
        if (read_string(r, key, sizeof key, "a key") || read_u32(r, &type, "a value type")) goto out;
        if (strcmp(key, "general.alignment") == 0) {
            if (type != T_U32) {
                fail(r, "general.alignment has value type %u, not uint32", type);
                goto out;
            }
            if (read_u32(r, &m.alignment, "general.alignment")) goto out;
            if (m.alignment == 0 || (m.alignment & (m.alignment - 1))) {
                fail(r, "general.alignment %u is not a power of two", m.alignment);
                goto out;
            }
        } else if (skip_value(r, type, 0)) {
            goto out;
        }
    }

    /* Tensor infos: keep the routed experts'. */
    char name[1024];
    for (uint64_t i = 0; i < m.num_tensors; ++i) {
        uint32_t n_dims, type;
        uint64_t ne[4] = {1, 1, 1, 1}, offset;
        if (read_string(r, name, sizeof name, "a tensor name") || read_u32(r, &n_dims, "a tensor's dimensions"))
            goto out;
        if (n_dims == 0 || n_dims > 4) {
            fail(r, "tensor %s has %u dimensions", name, n_dims);
            goto out;
        }
        for (uint32_t d = 0; d < n_dims; ++d)
            if (read_u64(r, &ne[d], "a tensor dimension")) goto out;
        if (read_u32(r, &type, "a tensor type") || read_u64(r, &offset, "a tensor offset")) goto out;
        uint32_t layer;
        int part = expert_part(name, &layer);
        if (part < 0) continue;
        if (part == 3) {
            fail(r, "tensor %s: fused gate_up expert tensors are not read by this loader", name);
            goto out;
        }
        int t = -1;
        for (size_t j = 0; j < sizeof k_types / sizeof k_types[0]; ++j)
            if (k_types[j].type == type) t = (int)j;
        if (t < 0) {
            fail(r, "tensor %s has ggml type %u, which this loader does not know", name, type);
            goto out;
        }
        if (n_dims != 3 || ne[0] % k_types[t].block_weights || ne[2] == 0 || ne[2] > 65536 || ne[1] > (1ull << 32) ||
            ne[0] > (1ull << 32)) {
            fail(r,
                 "tensor %s: shape [%llu, %llu, %llu] (%u dimensions) is not [row, rows, experts] of whole %s blocks",
                 name, (unsigned long long)ne[0], (unsigned long long)ne[1], (unsigned long long)ne[2], n_dims,
                 k_types[t].name);
            goto out;
        }
        found_t* f = &found[layer];
        if (f->parts & (1u << part)) {
            fail(r, "tensor %s appears twice", name);
            goto out;
        }
        if (f->parts && f->layer.num_experts != ne[2]) {
            fail(r, "tensor %s has %llu experts, the layer's other parts %u", name, (unsigned long long)ne[2],
                 f->layer.num_experts);
            goto out;
        }
        const uint64_t per_expert = ne[0] / k_types[t].block_weights * k_types[t].block_bytes * ne[1];
        f->parts |= 1u << part;
        f->layer.layer = layer;
        f->layer.num_experts = (uint32_t)ne[2];
        f->layer.type[part] = type;
        f->layer.offset[part] = offset; /* relative to the data until the data's start is known */
        f->layer.stride[part] = per_expert;
        f->layer.bytes[part] = per_expert;
    }
    m.data_offset = (r->pos + m.alignment - 1) / m.alignment * m.alignment;
    if (m.data_offset > r->size) {
        fail(r, "the tensor data would start at byte %llu, past the end of the file (%llu bytes)",
             (unsigned long long)m.data_offset, (unsigned long long)r->size);
        goto out;
    }

    for (uint32_t l = 0; l < GGUF_MAX_LAYERS; ++l) {
        if (!found[l].parts) continue;
        if (found[l].parts != 7) {
            fail(r, "layer %u has only some of its gate, up and down expert tensors", l);
            goto out;
        }
        ++m.num_layers;
    }
    m.layers = (gguf_moe_layer_t*)calloc(m.num_layers ? m.num_layers : 1, sizeof *m.layers);
    if (!m.layers) {
        fail(r, "out of memory");
        goto out;
    }
    uint32_t n = 0;
    for (uint32_t l = 0; l < GGUF_MAX_LAYERS; ++l) {
        if (!found[l].parts) continue;
        gguf_moe_layer_t* L = &m.layers[n++];
        *L = found[l].layer;
        for (int p = 0; p < 3; ++p) {
            const uint64_t rel = L->offset[p], tensor = L->stride[p] * L->num_experts;
            if (rel % m.alignment || rel > r->size || tensor > r->size - m.data_offset ||
                rel > r->size - m.data_offset - tensor) {
                fail(r, "layer %u part %d: data at %llu + %llu (%llu bytes) is misaligned or runs past the end (%llu)",
                     l, p, (unsigned long long)m.data_offset, (unsigned long long)rel, (unsigned long long)tensor,
                     (unsigned long long)r->size);
                free(m.layers);
                goto out;
            }
            L->offset[p] = m.data_offset + rel;
        }
    }
    *out = m;
    rc = 0;
out:
    free(r);
    free(found);
    return rc;
}

void gguf_free(gguf_model_t* model) {
    if (!model) return;
    free(model->layers);
    model->layers = NULL;
    model->num_layers = 0;
}
