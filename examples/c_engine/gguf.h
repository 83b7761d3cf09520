/*
 * gguf.h — the example engine's own GGUF loader: the v2/v3 header (magic, version, the key-value
 * pairs skipped by type but general.alignment, the tensor infos) and where each MoE layer's routed
 * expert tensors (blk.N.ffn_{gate,up,down}_exps.weight) lie in the file. An engine has a loader of
 * its own (ds4's, ggml's gguf.c); this is a small one, so the example shows what the cache needs
 * from it: per layer, each part's file offset, per-expert stride and per-expert bytes.
 */
#ifndef C_ENGINE_GGUF_H
#define C_ENGINE_GGUF_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define GGUF_MAX_LAYERS 4096

/** One MoE layer's routed experts: part p (0 gate, 1 up, 2 down) of expert e is at
 *  offset[p] + e * stride[p] in the file, bytes[p] long. */
typedef struct gguf_moe_layer_t {
    uint32_t layer;       /**< the model layer (the N of blk.N) */
    uint32_t num_experts; /**< the tensors' slowest dimension */
    uint32_t type[3];     /**< ggml type of each part's tensor */
    uint64_t offset[3];   /**< absolute file offset of expert 0's part */
    uint64_t stride[3];   /**< bytes between experts (a tensor's bytes / experts) */
    uint64_t bytes[3];    /**< bytes of one expert's part */
} gguf_moe_layer_t;

typedef struct gguf_model_t {
    uint32_t version;     /**< 2 or 3 */
    uint64_t num_tensors; /**< every tensor of the file */
    uint64_t num_kv;      /**< key-value pairs */
    uint32_t alignment;   /**< general.alignment, 32 when absent */
    uint64_t data_offset; /**< where the tensor data starts */
    uint64_t file_bytes;  /**< the file's size */
    uint32_t num_layers;  /**< MoE layers found, in increasing layer order */
    gguf_moe_layer_t* layers;
} gguf_model_t;

/** The name of ggml type `type` ("Q4_K"), "?" when the loader does not know it. */
const char* gguf_type_name(uint32_t type);

/**
 * Read the header of the GGUF file open as `fd` into *out (free it with gguf_free). Fails (nonzero,
 * with a line in `err`, `err_len` bytes) on a file that is not GGUF v2 or v3, is truncated or
 * corrupt, has an expert tensor of a type this loader does not know, a layer with some of its three
 * parts only or with parts of different expert counts, or tensor data past the end of the file.
 * Fused gate_up tensors are not read (DeepSeek V4 Flash's GGUFs keep gate and up apart).
 */
int gguf_load(int fd, gguf_model_t* out, char* err, unsigned err_len);

void gguf_free(gguf_model_t* model);

#ifdef __cplusplus
}
#endif

#endif /* C_ENGINE_GGUF_H */
