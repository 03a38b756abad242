/*
 * A fake NVIDIA Management Library (libnvidia-ml.so.1) for gpushare's tests.
 *
 * gpushared discovers GPUs through the nvml-wrapper crate, which loads NVML at run time. The
 * tests build this file into a shared library and point the daemon's `[nvml] library` at it,
 * so the daemon runs its one discovery code path unchanged on hosts with no GPU.
 *
 * It exports the functions nvml-wrapper calls for discovery, with NVML's C signatures and
 * struct layouts (nvml-wrapper-sys 0.10 bindings). The host it pretends to be is read at
 * nvmlInit from the file named by $FAKE_NVML_CONFIG (no variable: no GPUs), one directive per
 * line, '#' comments and blank lines ignored:
 *
 *   driver <version>                       driver version string (default 550.54.15)
 *   init_error <code>                      nvmlInit returns this NVML return code (e.g. 9)
 *   gpu <uuid> <memory_mib> <minor> <numa> <pci_bus_id> <name, rest of the line>
 *                                          one GPU, indexed in file order; numa -1: unknown
 *   gpu_error <index> <function> <code>    that function returns <code> for GPU <index>
 *
 * A malformed file makes nvmlInit return NVML_ERROR_UNKNOWN after one line on stderr naming
 * the file, the line and the problem. Build: cc -shared -fPIC -O1 -Wall -Wextra -o
 * libnvidia-ml.so.1 fake_nvml.c
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int nvmlReturn_t;
typedef struct fake_gpu *nvmlDevice_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_UNKNOWN = 999,
};

typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

#define MAX_GPUS 64
#define MAX_ERRORS 256

struct fake_gpu {
    unsigned int index;
    char uuid[96];
    char name[96];
    unsigned long long memory_mib;
    unsigned int minor;
    int numa;
    char bus_id[32];
};

struct fake_error {
    unsigned int index;
    char function[64];
    nvmlReturn_t code;
};

static struct fake_gpu gpus[MAX_GPUS];
static unsigned int gpu_count;
static struct fake_error errors[MAX_ERRORS];
static unsigned int error_count;
static char driver[80] = "550.54.15";
static int init_refs;

/* The code configured for `function` on GPU `index`, or NVML_SUCCESS. */
static nvmlReturn_t injected(const struct fake_gpu *g, const char *function) {
    for (unsigned int i = 0; i < error_count; i++)
        if (errors[i].index == g->index && strcmp(errors[i].function, function) == 0) return errors[i].code;
    return NVML_SUCCESS;
}

/* Common checks of a device call: initialised, valid handle, no injected error. */
static nvmlReturn_t check(nvmlDevice_t d, const void *out, const char *function) {
    if (init_refs == 0) return NVML_ERROR_UNINITIALIZED;
    if (d == NULL || d < gpus || d >= gpus + gpu_count || out == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    return injected(d, function);
}

static nvmlReturn_t copy_string(char *dst, unsigned int length, const char *src) {
    if (dst == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, strlen(src) + 1);
    return NVML_SUCCESS;
}

static int malformed(const char *path, int line, const char *why) {
    fprintf(stderr, "fake NVML: %s:%d: %s\n", path, line, why);
    return NVML_ERROR_UNKNOWN;
}

/* Reads $FAKE_NVML_CONFIG; returns the code nvmlInit should return. */
static nvmlReturn_t load(void) {
    gpu_count = 0;
    error_count = 0;
    strcpy(driver, "550.54.15");
    const char *path = getenv("FAKE_NVML_CONFIG");
    if (path == NULL || *path == '\0') return NVML_SUCCESS;
    FILE *f = fopen(path, "r");
    if (f == NULL) return malformed(path, 0, "cannot open the file");
    nvmlReturn_t result = NVML_SUCCESS;
    char text[512];
    for (int line = 1; fgets(text, sizeof text, f) != NULL; line++) {
        text[strcspn(text, "\r\n")] = '\0';
        char *s = text + strspn(text, " \t");
        if (*s == '\0' || *s == '#') continue;
        int used = 0;
        if (strncmp(s, "driver ", 7) == 0) {
            if (sscanf(s + 7, "%79s", driver) != 1) { result = malformed(path, line, "driver needs a version"); break; }
        } else if (strncmp(s, "init_error ", 11) == 0) {
            int code;
            if (sscanf(s + 11, "%d", &code) != 1) { result = malformed(path, line, "init_error needs a code"); break; }
            if (result == NVML_SUCCESS) result = code;
        } else if (strncmp(s, "gpu_error ", 10) == 0) {
            struct fake_error e;
            if (error_count == MAX_ERRORS || sscanf(s + 10, "%u %63s %d", &e.index, e.function, &e.code) != 3) {
                result = malformed(path, line, "gpu_error needs <index> <function> <code>");
                break;
            }
            errors[error_count++] = e;
        } else if (strncmp(s, "gpu ", 4) == 0) {
            struct fake_gpu g;
            memset(&g, 0, sizeof g);
            if (gpu_count == MAX_GPUS ||
                sscanf(s + 4, "%95s %llu %u %d %31s %n", g.uuid, &g.memory_mib, &g.minor, &g.numa, g.bus_id, &used) < 5 ||
                used == 0 || s[4 + used] == '\0') {
                result = malformed(path, line, "gpu needs <uuid> <memory_mib> <minor> <numa> <pci_bus_id> <name>");
                break;
            }
            snprintf(g.name, sizeof g.name, "%s", s + 4 + used);
            g.index = gpu_count;
            gpus[gpu_count++] = g;
        } else {
            result = malformed(path, line, "unknown directive");
            break;
        }
    }
    fclose(f);
    return result;
}

nvmlReturn_t nvmlInit_v2(void) {
    if (init_refs > 0) {
        init_refs++;
        return NVML_SUCCESS;
    }
    nvmlReturn_t r = load();
    if (r == NVML_SUCCESS) init_refs = 1;
    return r;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    return nvmlInit_v2();
}

nvmlReturn_t nvmlShutdown(void) {
    if (init_refs == 0) return NVML_ERROR_UNINITIALIZED;
    init_refs--;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    if (init_refs == 0) return NVML_ERROR_UNINITIALIZED;
    return copy_string(version, length, driver);
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (init_refs == 0) return NVML_ERROR_UNINITIALIZED;
    if (count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *count = gpu_count;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (init_refs == 0) return NVML_ERROR_UNINITIALIZED;
    if (device == NULL || index >= gpu_count) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t r = injected(&gpus[index], "nvmlDeviceGetHandleByIndex_v2");
    if (r == NVML_SUCCESS) *device = &gpus[index];
    return r;
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    if (init_refs == 0) return NVML_ERROR_UNINITIALIZED;
    if (uuid == NULL || device == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < gpu_count; i++)
        if (strcmp(gpus[i].uuid, uuid) == 0) {
            *device = &gpus[i];
            return NVML_SUCCESS;
        }
    return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t d, unsigned int *index) {
    nvmlReturn_t r = check(d, index, "nvmlDeviceGetIndex");
    if (r == NVML_SUCCESS) *index = d->index;
    return r;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned int length) {
    nvmlReturn_t r = check(d, uuid, "nvmlDeviceGetUUID");
    return r == NVML_SUCCESS ? copy_string(uuid, length, d->uuid) : r;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned int length) {
    nvmlReturn_t r = check(d, name, "nvmlDeviceGetName");
    return r == NVML_SUCCESS ? copy_string(name, length, d->name) : r;
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t d, unsigned int *minor) {
    nvmlReturn_t r = check(d, minor, "nvmlDeviceGetMinorNumber");
    if (r == NVML_SUCCESS) *minor = d->minor;
    return r;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *memory) {
    nvmlReturn_t r = check(d, memory, "nvmlDeviceGetMemoryInfo_v2");
    if (r != NVML_SUCCESS) return r;
    memory->total = d->memory_mib * 1024ULL * 1024ULL;
    memory->reserved = 0;
    memory->used = 0;
    memory->free = memory->total;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *memory) {
    nvmlReturn_t r = check(d, memory, "nvmlDeviceGetMemoryInfo");
    if (r != NVML_SUCCESS) return r;
    memory->total = d->memory_mib * 1024ULL * 1024ULL;
    memory->used = 0;
    memory->free = memory->total;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t d, nvmlPciInfo_t *pci) {
    nvmlReturn_t r = check(d, pci, "nvmlDeviceGetPciInfo_v3");
    if (r != NVML_SUCCESS) return r;
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busId, sizeof pci->busId, "%s", d->bus_id);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%s", d->bus_id + (strlen(d->bus_id) > 12 ? 4 : 0));
    sscanf(d->bus_id, "%x:%x:%x", &pci->domain, &pci->bus, &pci->device);
    pci->pciDeviceId = 0x1eb810de; /* Tesla T4 */
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t d, unsigned int *node) {
    nvmlReturn_t r = check(d, node, "nvmlDeviceGetNumaNodeId");
    if (r != NVML_SUCCESS) return r;
    if (d->numa < 0) return NVML_ERROR_NOT_SUPPORTED;
    *node = (unsigned int)d->numa;
    return NVML_SUCCESS;
}
