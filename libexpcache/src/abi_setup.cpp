// The C ABI's setup calls: the version, the policy table's names, a config's and a layer
// description's defaults, the backend in use, registering and unregistering layers, files, the
// budgets and reserve of a live cache, and where log lines go.
#include "abi_checks.hpp"
#include "config.hpp"
#include "policy/policy.hpp"

using expcache::abi::check_handle;
using expcache::abi::check_struct;
using expcache::abi::guarded;

extern "C" {

uint32_t expcache_version(void) {
    return EXPCACHE_VERSION_MAJOR * 10000 + EXPCACHE_VERSION_MINOR * 100 + EXPCACHE_VERSION_PATCH;
}

const char* expcache_policy_name(uint32_t policy) {
    return expcache::policy_name(policy);
}

expcache_status_t expcache_config_init(expcache_config_t* config) {
    return guarded(__func__, [&] {
        EXPCACHE_REQUIRE(config, "config is NULL");
        expcache::config_defaults(config);
        return EXPCACHE_OK;
    });
}

expcache_status_t expcache_layer_desc_init(expcache_layer_desc_t* desc) {
    return guarded(__func__, [&] {
        EXPCACHE_REQUIRE(desc, "desc is NULL");
        *desc = expcache_layer_desc_t{};
        desc->struct_size = sizeof *desc;
        return EXPCACHE_OK;
    });
}

expcache_status_t expcache_backend_get(const expcache_t* cache, uint32_t* out_backend) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(out_backend, "out_backend is NULL");
        *out_backend = cache->impl->backend_kind();
        return EXPCACHE_OK;
    });
}

expcache_status_t expcache_layer_register(expcache_t* cache, uint32_t layer, const expcache_layer_desc_t* desc) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_TRY(check_struct(desc, "desc"));
        return cache->impl->register_layer(layer, *desc);
    });
}

expcache_status_t expcache_layers_register(expcache_t* cache, uint32_t n, const uint32_t* layers,
                                           const expcache_layer_desc_t* descs) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(layers && descs, "layers and descs must not be NULL");
        EXPCACHE_REQUIRE(n >= 1 && n <= (1u << 20), "n must be 1..%u, got %u", 1u << 20, n);
        for (uint32_t i = 0; i < n; ++i)
            EXPCACHE_REQUIRE(descs[i].struct_size == sizeof(expcache_layer_desc_t),
                             "descs[%u].struct_size is %u, expected %zu (header/library mismatch?)", i,
                             descs[i].struct_size, sizeof(expcache_layer_desc_t));
        return cache->impl->register_layers(n, layers, descs);
    });
}

expcache_status_t expcache_layer_unregister(expcache_t* cache, uint32_t layer) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        return cache->impl->unregister_layer(layer);
    });
}

expcache_status_t expcache_budget_set(expcache_t* cache, uint64_t budget_experts, uint64_t budget_bytes) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        return cache->impl->set_budget(budget_experts, budget_bytes);
    });
}

expcache_status_t expcache_reserve_set(expcache_t* cache, uint64_t reserve_bytes) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        return cache->impl->set_reserve(reserve_bytes);
    });
}

expcache_status_t expcache_budget_get(const expcache_t* cache, uint64_t* out_budget_experts, uint64_t* out_budget_bytes,
                                      uint32_t* out_free_memory) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(out_budget_experts && out_budget_bytes,
                         "out_budget_experts and out_budget_bytes must not be NULL");
        return cache->impl->get_budget(out_budget_experts, out_budget_bytes, out_free_memory);
    });
}

expcache_status_t expcache_device_memory_get(expcache_t* cache, uint64_t* out_free, uint64_t* out_total) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(out_free && out_total, "out_free and out_total must not be NULL");
        return cache->impl->device_memory(out_free, out_total);
    });
}

expcache_status_t expcache_file_open(expcache_t* cache, const char* path, uint32_t* out_file) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(path && path[0], "path is NULL or empty");
        EXPCACHE_REQUIRE(out_file, "out_file is NULL");
        return cache->impl->open_file(path, -1, out_file);
    });
}

expcache_status_t expcache_file_open_fd(expcache_t* cache, int fd, uint32_t* out_file) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(fd >= 0, "fd %d is not a file descriptor", fd);
        EXPCACHE_REQUIRE(out_file, "out_file is NULL");
        return cache->impl->open_file(nullptr, fd, out_file);
    });
}

expcache_status_t expcache_log_set_callback(expcache_t* cache, expcache_log_fn fn, void* user) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        return cache->impl->set_log_callback(fn, user);
    });
}

expcache_status_t expcache_log_set_level(expcache_t* cache, uint32_t level) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        return cache->impl->set_log_level(level);
    });
}

}  // extern "C"
