/*
 * A fake NVIDIA Management Library (libnvidia-ml.so.1) for gpushare's tests.
 *
 * gpushared discovers GPUs and watches their health through the nvml-wrapper crate, which
 * loads NVML at run time. The tests build this file into a shared library and point the
 * daemon's `[nvml] library` at it, so the daemon runs its one NVML code path unchanged on
 * hosts with no GPU.
 *
 * It exports the functions nvml-wrapper calls for discovery and for events, with NVML's C
 * signatures and struct layouts (nvml-wrapper-sys 0.10 bindings), and the further ones NVIDIA's
 * k8s-device-plugin (v0.19, through go-nvml) calls, so that the peer runs unmodified on the same
 * simulated GPUs (docs/comparison.md): the CUDA compute capability (7.5 for every GPU); and
 * those Alibaba's gpushare-device-plugin calls through NVIDIA's older gpu-monitoring-tools
 * bindings: the power limit, maximum clocks, PCIe link, BAR1 memory and topology, fixed values
 * of an A100-class board; and those NVIDIA's DRA driver calls as it enumerates the GPUs
 * (architecture Ampere, brand NVIDIA, no MIG, CUDA driver 12.8). The host it pretends to be
 * is read at nvmlInit (the first one, or the first after the last nvmlShutdown) from the file
 * named by $FAKE_NVML_CONFIG; with no variable, from `<this library's path>.conf` (e.g.
 * libnvidia-ml.so.1.conf beside the library) if there is one, for in-process tests that cannot
 * set the environment; otherwise the host has no GPUs. One directive per line, '#' comments
 * and blank lines ignored:
 *
 *   driver <version>                       driver version string (default 550.54.15)
 *   init_error <code>                      nvmlInit returns this NVML return code (e.g. 9)
 *   gpu <uuid> <memory_mib> <minor> <numa> <pci_bus_id> <name, rest of the line>
 *                                          one GPU, indexed in file order; numa -1: unknown
 *   gpu_error <index> <function> <code>    that function returns <code> for GPU <index>
 *   event_types <index> <mask>             the event types GPU <index> supports (decimal or
 *                                          0x hex; default 0xf: single-bit ECC 0x1, double-bit
 *                                          ECC 0x2, P-state 0x4, Xid 0x8)
 *   events <path, rest of the line>        the event file (below); default $FAKE_NVML_EVENTS
 *
 * A malformed file makes nvmlInit return NVML_ERROR_UNKNOWN after one line on stderr naming
 * the file, the line and the problem.
 *
 * The event file is how a test injects GPU events while the process using the library runs:
 * the test appends whole lines (one write each) and the library reads the complete lines that
 * are new on every nvmlEventSetWait(_v2) and every per-device query (a trailing line without
 * its newline waits for the next read). At nvmlInit the file is read from its beginning, so a
 * restarted process sees the GPUs as the file left them; a file that shrank is read again from
 * its beginning; a missing file is an empty one. One event per line, '#' comments and blank
 * lines ignored:
 *
 *   xid <index> <code>        an Xid critical error event (type 0x8, eventData <code>)
 *   ecc_dbe <index>           a double-bit ECC error event (type 0x2)
 *   ecc_sbe <index>           a single-bit ECC error event (type 0x1)
 *   lost <index>              the GPU stops answering: every per-device call (handle by index
 *                             or UUID, index, UUID, name, minor, memory, PCI, NUMA, event types,
 *                             event registration) returns NVML_ERROR_GPU_IS_LOST (15)
 *   recover <index>           the GPU answers again
 *   util <index> <percent>    the GPU's utilisation from now on (nvmlDeviceGetUtilizationRates,
 *                             0-100; the memory rate reported is the same); default 0
 *   used <index> <mib>        memory in use on the GPU from now on (nvmlDeviceGetMemoryInfo's
 *                             used, at most the total); default 0
 *   proc <index> <pid> <mib>  process <pid> runs on the GPU using <mib> MiB from now on (listed by
 *                             nvmlDeviceGetComputeRunningProcesses_v3 and, alike,
 *                             nvmlDeviceGetMPSComputeRunningProcesses_v3); at most 64 per GPU
 *   proc_end <index> <pid>    the process no longer runs on the GPU
 *
 * An event goes to every event set on which that type was registered for that GPU (lost or
 * not), queued there until nvmlEventSetWait takes it (at most 256 per set: more are dropped
 * with a line on stderr). nvmlEventSetWait returns NVML_ERROR_TIMEOUT (10) when nothing came
 * within its timeout; it looks every 10 ms. A malformed line (unknown kind, no such GPU, bad
 * number) costs one line on stderr naming the file and line, and is otherwise ignored.
 *
 * The library is safe to call from several threads (one mutex; the wait sleeps without it).
 *
 * Build: cc -shared -fPIC -pthread -O1 -Wall -Wextra -Werror -o libnvidia-ml.so.1 fake_nvml.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int nvmlReturn_t;
typedef struct fake_gpu *nvmlDevice_t;
typedef struct nvmlEventSet_st *nvmlEventSet_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_MEMORY = 20,
    NVML_ERROR_UNKNOWN = 999,
};

/* nvmlEventType* bits. */
#define EVENT_SINGLE_BIT_ECC 0x1ULL
#define EVENT_DOUBLE_BIT_ECC 0x2ULL
#define EVENT_PSTATE 0x4ULL
#define EVENT_XID 0x8ULL
#define DEFAULT_EVENT_TYPES (EVENT_SINGLE_BIT_ECC | EVENT_DOUBLE_BIT_ECC | EVENT_PSTATE | EVENT_XID)

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

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

#define MAX_GPUS 64
#define MAX_ERRORS 256
#define MAX_SETS 64
#define MAX_QUEUED 256
#define WAIT_STEP_MS 10
#define MAX_PROCS 64

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

/* An event set: the types registered per GPU, and the events waiting to be taken. */
struct nvmlEventSet_st {
    unsigned long long types[MAX_GPUS];
    nvmlEventData_t queue[MAX_QUEUED];
    unsigned int head, count;
};

/* Everything below is guarded by `mutex`. */
static pthread_mutex_t mutex = PTHREAD_MUTEX_INITIALIZER;
static struct fake_gpu gpus[MAX_GPUS];
static unsigned int gpu_count;
static struct fake_error errors[MAX_ERRORS];
static unsigned int error_count;
static unsigned long long event_types[MAX_GPUS];
static char driver[80] = "550.54.15";
static int init_refs;
static struct nvmlEventSet_st *sets[MAX_SETS];
static int lost[MAX_GPUS];
static unsigned int utilization[MAX_GPUS];
static unsigned long long used_mib[MAX_GPUS];
static unsigned int proc_pid[MAX_GPUS][MAX_PROCS];
static unsigned long long proc_mib[MAX_GPUS][MAX_PROCS];
static unsigned int proc_count[MAX_GPUS];
static char events_path[4096];
static long long events_offset;
static int events_line;

static void lock(void) { pthread_mutex_lock(&mutex); }
static void unlock(void) { pthread_mutex_unlock(&mutex); }

/* The code configured for `function` on GPU `index`, or NVML_SUCCESS. */
static nvmlReturn_t injected(const struct fake_gpu *g, const char *function) {
    for (unsigned int i = 0; i < error_count; i++)
        if (errors[i].index == g->index && strcmp(errors[i].function, function) == 0) return errors[i].code;
    return NVML_SUCCESS;
}

static int malformed(const char *path, int line, const char *why) {
    fprintf(stderr, "fake NVML: %s:%d: %s\n", path, line, why);
    return NVML_ERROR_UNKNOWN;
}

/* Parses a whole token as an unsigned number (decimal, or hex with 0x); 0 when it is not one. */
static int parse_number(const char *token, unsigned long long *value) {
    if (token == NULL || *token < '0' || *token > '9') return 0;
    char *end = NULL;
    *value = strtoull(token, &end, 0);
    return end != token && *end == '\0';
}

/* Queues an event on every set that registered `type` for GPU `index`. */
static void deliver(unsigned int index, unsigned long long type, unsigned long long data) {
    for (unsigned int i = 0; i < MAX_SETS; i++) {
        struct nvmlEventSet_st *set = sets[i];
        if (set == NULL || (set->types[index] & type) == 0) continue;
        if (set->count == MAX_QUEUED) {
            fprintf(stderr, "fake NVML: %s:%d: an event set holds %d events already; event dropped\n", events_path,
                    events_line, MAX_QUEUED);
            continue;
        }
        nvmlEventData_t *e = &set->queue[(set->head + set->count) % MAX_QUEUED];
        memset(e, 0, sizeof *e);
        e->device = &gpus[index];
        e->eventType = type;
        e->eventData = data;
        e->gpuInstanceId = 0xFFFFFFFFu; /* not MIG */
        e->computeInstanceId = 0xFFFFFFFFu;
        set->count++;
    }
}

static void bad_event(const char *why) {
    fprintf(stderr, "fake NVML: %s:%d: %s; line ignored\n", events_path, events_line, why);
}

/* Applies one line of the event file. */
static void apply_event(char *text) {
    text[strcspn(text, "\r\n")] = '\0';
    char *tokens[4];
    int n = 0;
    char *save = NULL;
    for (char *t = strtok_r(text, " \t", &save); t != NULL && n < 4; t = strtok_r(NULL, " \t", &save)) tokens[n++] = t;
    if (n == 0 || tokens[0][0] == '#') return;
    unsigned long long index, code = 0;
    const char *kind = tokens[0];
    if (strcmp(kind, "util") == 0 || strcmp(kind, "used") == 0) {
        unsigned long long value;
        if (n != 3 || !parse_number(tokens[1], &index) || !parse_number(tokens[2], &value)) {
            bad_event("util and used need <gpu-index> <number>");
        } else if (index >= gpu_count) {
            bad_event("no GPU with that index");
        } else if (kind[1] == 't' && value > 100) {
            bad_event("a utilisation is a percentage, 0 to 100");
        } else if (kind[1] == 's' && value > gpus[index].memory_mib) {
            bad_event("more memory in use than the GPU has");
        } else if (kind[1] == 't') {
            utilization[index] = (unsigned int)value;
        } else {
            used_mib[index] = value;
        }
        return;
    }
    if (strcmp(kind, "proc") == 0 || strcmp(kind, "proc_end") == 0) {
        int end = kind[4] == '_';
        unsigned long long pid, mib = 0;
        if (n != (end ? 3 : 4) || !parse_number(tokens[1], &index) || !parse_number(tokens[2], &pid) ||
            (!end && !parse_number(tokens[3], &mib)) || pid == 0 || pid > 0xFFFFFFFFULL) {
            bad_event(end ? "proc_end needs <gpu-index> <pid>" : "proc needs <gpu-index> <pid> <mib>");
            return;
        }
        if (index >= gpu_count) {
            bad_event("no GPU with that index");
            return;
        }
        unsigned int g = (unsigned int)index, at = 0;
        while (at < proc_count[g] && proc_pid[g][at] != (unsigned int)pid) at++;
        if (end) {
            if (at == proc_count[g]) return;
            proc_count[g]--;
            proc_pid[g][at] = proc_pid[g][proc_count[g]];
            proc_mib[g][at] = proc_mib[g][proc_count[g]];
        } else if (at == proc_count[g] && proc_count[g] == MAX_PROCS) {
            bad_event("the GPU runs 64 processes already");
        } else {
            if (at == proc_count[g]) proc_count[g]++;
            proc_pid[g][at] = (unsigned int)pid;
            proc_mib[g][at] = mib;
        }
        return;
    }
    int xid = strcmp(kind, "xid") == 0;
    if (!xid && strcmp(kind, "ecc_dbe") != 0 && strcmp(kind, "ecc_sbe") != 0 && strcmp(kind, "lost") != 0 &&
        strcmp(kind, "recover") != 0) {
        bad_event("unknown event (xid, ecc_dbe, ecc_sbe, lost, recover, util, used, proc, proc_end)");
        return;
    }
    if (n != (xid ? 3 : 2) || !parse_number(tokens[1], &index) || (xid && !parse_number(tokens[2], &code))) {
        bad_event(xid ? "xid needs <gpu-index> <code>" : "the event needs <gpu-index> and nothing else");
        return;
    }
    if (index >= gpu_count) {
        bad_event("no GPU with that index");
        return;
    }
    unsigned int i = (unsigned int)index;
    if (xid) deliver(i, EVENT_XID, code);
    else if (strcmp(kind, "ecc_dbe") == 0) deliver(i, EVENT_DOUBLE_BIT_ECC, 0);
    else if (strcmp(kind, "ecc_sbe") == 0) deliver(i, EVENT_SINGLE_BIT_ECC, 0);
    else lost[i] = strcmp(kind, "lost") == 0;
}

/* Reads the complete lines appended to the event file since the last read. */
static void poll_events(void) {
    if (init_refs == 0 || events_path[0] == '\0') return;
    FILE *f = fopen(events_path, "r");
    if (f == NULL) return;
    if (fseeko(f, 0, SEEK_END) == 0 && ftello(f) < events_offset) {
        events_offset = 0;
        events_line = 0;
    }
    if (fseeko(f, events_offset, SEEK_SET) != 0) {
        fclose(f);
        return;
    }
    char *text = NULL;
    size_t size = 0;
    ssize_t length;
    while ((length = getline(&text, &size, f)) > 0 && text[length - 1] == '\n') {
        events_offset += length;
        events_line++;
        apply_event(text);
    }
    free(text);
    fclose(f);
}

/* The answer of a GPU to any call, before the call's own checks. */
static nvmlReturn_t device_state(const struct fake_gpu *g, const char *function) {
    poll_events();
    if (lost[g->index]) return NVML_ERROR_GPU_IS_LOST;
    return injected(g, function);
}

/* Common checks of a device call, with the mutex held: initialised, valid handle, answering, no injected error. */
static nvmlReturn_t check_locked(nvmlDevice_t d, const void *out, const char *function) {
    if (init_refs == 0) return NVML_ERROR_UNINITIALIZED;
    if (d == NULL || d < gpus || d >= gpus + gpu_count || out == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    return device_state(d, function);
}

static nvmlReturn_t check(nvmlDevice_t d, const void *out, const char *function) {
    lock();
    nvmlReturn_t r = check_locked(d, out, function);
    unlock();
    return r;
}

static nvmlReturn_t copy_string(char *dst, unsigned int length, const char *src) {
    if (dst == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, strlen(src) + 1);
    return NVML_SUCCESS;
}

/* The configuration file: $FAKE_NVML_CONFIG, else `<this library>.conf` if it exists, else none. */
static const char *config_path(char *buffer, size_t size) {
    const char *path = getenv("FAKE_NVML_CONFIG");
    if (path != NULL && *path != '\0') return path;
    Dl_info info;
    if (dladdr(&gpu_count, &info) == 0 || info.dli_fname == NULL) return NULL;
    int n = snprintf(buffer, size, "%s.conf", info.dli_fname);
    if (n < 0 || (size_t)n >= size) return NULL;
    FILE *f = fopen(buffer, "r");
    if (f == NULL) return NULL;
    fclose(f);
    return buffer;
}

/* Reads the configuration; returns the code nvmlInit should return. */
static nvmlReturn_t load(void) {
    gpu_count = 0;
    error_count = 0;
    strcpy(driver, "550.54.15");
    for (unsigned int i = 0; i < MAX_GPUS; i++) {
        event_types[i] = DEFAULT_EVENT_TYPES;
        lost[i] = 0;
        utilization[i] = 0;
        used_mib[i] = 0;
        proc_count[i] = 0;
    }
    const char *events = getenv("FAKE_NVML_EVENTS");
    snprintf(events_path, sizeof events_path, "%s", events != NULL ? events : "");
    events_offset = 0;
    events_line = 0;
    char buffer[4096];
    const char *path = config_path(buffer, sizeof buffer);
    if (path == NULL) return NVML_SUCCESS;
    FILE *f = fopen(path, "r");
    if (f == NULL) return malformed(path, 0, "cannot open the file");
    nvmlReturn_t result = NVML_SUCCESS;
    char text[4200];
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
        } else if (strncmp(s, "event_types ", 12) == 0) {
            char index[32], mask[32];
            unsigned long long i, m;
            if (sscanf(s + 12, "%31s %31s %n", index, mask, &used) != 2 || s[12 + used] != '\0' ||
                !parse_number(index, &i) || !parse_number(mask, &m) || i >= MAX_GPUS) {
                result = malformed(path, line, "event_types needs <index> <mask>");
                break;
            }
            event_types[i] = m;
        } else if (strncmp(s, "events ", 7) == 0) {
            const char *p = s + 7 + strspn(s + 7, " \t");
            size_t n = strlen(p);
            while (n > 0 && (p[n - 1] == ' ' || p[n - 1] == '\t')) n--;
            if (n == 0 || n >= sizeof events_path) { result = malformed(path, line, "events needs a path"); break; }
            memcpy(events_path, p, n);
            events_path[n] = '\0';
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
    lock();
    nvmlReturn_t r = NVML_SUCCESS;
    if (init_refs > 0) init_refs++;
    else if ((r = load()) == NVML_SUCCESS) init_refs = 1;
    unlock();
    return r;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    return nvmlInit_v2();
}

nvmlReturn_t nvmlShutdown(void) {
    lock();
    nvmlReturn_t r = NVML_SUCCESS;
    if (init_refs == 0) r = NVML_ERROR_UNINITIALIZED;
    else init_refs--;
    unlock();
    return r;
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
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    lock();
    nvmlReturn_t r = init_refs == 0 ? NVML_ERROR_UNINITIALIZED : copy_string(version, length, driver);
    unlock();
    return r;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    lock();
    nvmlReturn_t r = NVML_SUCCESS;
    if (init_refs == 0) r = NVML_ERROR_UNINITIALIZED;
    else if (count == NULL) r = NVML_ERROR_INVALID_ARGUMENT;
    else *count = gpu_count;
    unlock();
    return r;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    lock();
    nvmlReturn_t r = NVML_SUCCESS;
    if (init_refs == 0) r = NVML_ERROR_UNINITIALIZED;
    else if (device == NULL || index >= gpu_count) r = NVML_ERROR_INVALID_ARGUMENT;
    else if ((r = device_state(&gpus[index], "nvmlDeviceGetHandleByIndex_v2")) == NVML_SUCCESS) *device = &gpus[index];
    unlock();
    return r;
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    lock();
    nvmlReturn_t r = NVML_ERROR_NOT_FOUND;
    if (init_refs == 0) r = NVML_ERROR_UNINITIALIZED;
    else if (uuid == NULL || device == NULL) r = NVML_ERROR_INVALID_ARGUMENT;
    else
        for (unsigned int i = 0; i < gpu_count; i++)
            if (strcmp(gpus[i].uuid, uuid) == 0) {
                if ((r = device_state(&gpus[i], "nvmlDeviceGetHandleByUUID")) == NVML_SUCCESS) *device = &gpus[i];
                break;
            }
    unlock();
    return r;
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
    lock();
    memory->total = d->memory_mib * 1024ULL * 1024ULL;
    memory->reserved = 0;
    memory->used = used_mib[d->index] * 1024ULL * 1024ULL;
    memory->free = memory->total - memory->used;
    unlock();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *memory) {
    nvmlReturn_t r = check(d, memory, "nvmlDeviceGetMemoryInfo");
    if (r != NVML_SUCCESS) return r;
    lock();
    memory->total = d->memory_mib * 1024ULL * 1024ULL;
    memory->used = used_mib[d->index] * 1024ULL * 1024ULL;
    memory->free = memory->total - memory->used;
    unlock();
    return NVML_SUCCESS;
}

typedef struct {
    unsigned int gpu, memory;
} nvmlUtilization_t;

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *utilization_out) {
    nvmlReturn_t r = check(d, utilization_out, "nvmlDeviceGetUtilizationRates");
    if (r != NVML_SUCCESS) return r;
    lock();
    utilization_out->gpu = utilization[d->index];
    utilization_out->memory = utilization[d->index];
    unlock();
    return NVML_SUCCESS;
}

/* nvmlProcessInfo_t (nvmlProcessInfo_v2_t): what the _v3 process queries fill. */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

/* The processes on a GPU: with *count too small (or no buffer), the count needed and
 * NVML_ERROR_INSUFFICIENT_SIZE, as NVML does. */
static nvmlReturn_t processes(nvmlDevice_t d, unsigned int *count, nvmlProcessInfo_t *infos, const char *function) {
    lock();
    nvmlReturn_t r = check_locked(d, count, function);
    if (r == NVML_SUCCESS) {
        unsigned int n = proc_count[d->index];
        if (*count < n || (infos == NULL && n > 0)) {
            r = NVML_ERROR_INSUFFICIENT_SIZE;
        } else {
            for (unsigned int i = 0; i < n; i++) {
                infos[i].pid = proc_pid[d->index][i];
                infos[i].usedGpuMemory = proc_mib[d->index][i] * 1024ULL * 1024ULL;
                infos[i].gpuInstanceId = 0xFFFFFFFFu; /* not MIG */
                infos[i].computeInstanceId = 0xFFFFFFFFu;
            }
        }
        *count = n;
    }
    unlock();
    return r;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *count, nvmlProcessInfo_t *infos) {
    return processes(d, count, infos, "nvmlDeviceGetComputeRunningProcesses_v3");
}

nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *count, nvmlProcessInfo_t *infos) {
    return processes(d, count, infos, "nvmlDeviceGetMPSComputeRunningProcesses_v3");
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

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t d, int *major, int *minor) {
    nvmlReturn_t r = check(d, major, "nvmlDeviceGetCudaComputeCapability");
    if (r != NVML_SUCCESS) return r;
    if (minor == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *major = 7;
    *minor = 5;
    return NVML_SUCCESS;
}

/* Device facts Alibaba's gpushare-device-plugin reads through NVIDIA's gpu-monitoring-tools
 * bindings (nvml.NewDevice) before it serves: fixed values of an A100-class board. */
nvmlReturn_t nvmlDeviceGetPowerManagementLimit(nvmlDevice_t d, unsigned int *milliwatts) {
    nvmlReturn_t r = check(d, milliwatts, "nvmlDeviceGetPowerManagementLimit");
    if (r == NVML_SUCCESS) *milliwatts = 400000;
    return r;
}

nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t d, int type, unsigned int *mhz) {
    nvmlReturn_t r = check(d, mhz, "nvmlDeviceGetMaxClockInfo");
    if (r == NVML_SUCCESS) *mhz = type == 2 ? 1215 : 1410; /* NVML_CLOCK_MEM is 2 */
    return r;
}

nvmlReturn_t nvmlDeviceGetMaxPcieLinkGeneration(nvmlDevice_t d, unsigned int *generation) {
    nvmlReturn_t r = check(d, generation, "nvmlDeviceGetMaxPcieLinkGeneration");
    if (r == NVML_SUCCESS) *generation = 4;
    return r;
}

nvmlReturn_t nvmlDeviceGetMaxPcieLinkWidth(nvmlDevice_t d, unsigned int *width) {
    nvmlReturn_t r = check(d, width, "nvmlDeviceGetMaxPcieLinkWidth");
    if (r == NVML_SUCCESS) *width = 16;
    return r;
}

typedef struct {
    unsigned long long bar1Total;
    unsigned long long bar1Free;
    unsigned long long bar1Used;
} nvmlBAR1Memory_t;

nvmlReturn_t nvmlDeviceGetBAR1MemoryInfo(nvmlDevice_t d, nvmlBAR1Memory_t *bar1) {
    nvmlReturn_t r = check(d, bar1, "nvmlDeviceGetBAR1MemoryInfo");
    if (r != NVML_SUCCESS) return r;
    bar1->bar1Total = 64ULL << 30;
    bar1->bar1Free = bar1->bar1Total;
    bar1->bar1Used = 0;
    return NVML_SUCCESS;
}

/* Every pair of GPUs shares the host bridge (NVML_TOPOLOGY_HOSTBRIDGE, 30). */
nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t a, nvmlDevice_t b, int *level) {
    nvmlReturn_t r = check(a, level, "nvmlDeviceGetTopologyCommonAncestor");
    if (r != NVML_SUCCESS) return r;
    r = check(b, level, "nvmlDeviceGetTopologyCommonAncestor");
    if (r == NVML_SUCCESS) *level = a == b ? 0 : 30;
    return r;
}

nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t d, unsigned int *node) {
    nvmlReturn_t r = check(d, node, "nvmlDeviceGetNumaNodeId");
    if (r != NVML_SUCCESS) return r;
    if (d->numa < 0) return NVML_ERROR_NOT_SUPPORTED;
    *node = (unsigned int)d->numa;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t d, unsigned long long *types) {
    lock();
    nvmlReturn_t r = check_locked(d, types, "nvmlDeviceGetSupportedEventTypes");
    if (r == NVML_SUCCESS) *types = event_types[d->index];
    unlock();
    return r;
}

/* The slot of a live event set, or -1. */
static int set_slot(nvmlEventSet_t set) {
    for (int i = 0; i < MAX_SETS; i++)
        if (set != NULL && sets[i] == set) return i;
    return -1;
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    lock();
    nvmlReturn_t r = NVML_ERROR_MEMORY;
    if (init_refs == 0) r = NVML_ERROR_UNINITIALIZED;
    else if (set == NULL) r = NVML_ERROR_INVALID_ARGUMENT;
    else
        for (int i = 0; i < MAX_SETS; i++)
            if (sets[i] == NULL) {
                if ((sets[i] = calloc(1, sizeof *sets[i])) != NULL) {
                    *set = sets[i];
                    r = NVML_SUCCESS;
                }
                break;
            }
    unlock();
    return r;
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    lock();
    int slot = set_slot(set);
    if (slot >= 0) {
        free(sets[slot]);
        sets[slot] = NULL;
    }
    unlock();
    return slot >= 0 ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t d, unsigned long long types, nvmlEventSet_t set) {
    lock();
    nvmlReturn_t r = check_locked(d, set, "nvmlDeviceRegisterEvents");
    if (r == NVML_SUCCESS && set_slot(set) < 0) r = NVML_ERROR_INVALID_ARGUMENT;
    else if (r == NVML_SUCCESS && (types & ~event_types[d->index]) != 0) r = NVML_ERROR_NOT_SUPPORTED;
    else if (r == NVML_SUCCESS) set->types[d->index] |= types;
    unlock();
    return r;
}

static long long milliseconds_since(const struct timespec *start) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    /* Whole milliseconds elapsed: in nanoseconds first, so a negative nanosecond difference is
     * not rounded toward zero (that would count up to 1 ms too many, and time out early). */
    long long ns = (long long)(now.tv_sec - start->tv_sec) * 1000000000LL + (now.tv_nsec - start->tv_nsec);
    return ns / 1000000;
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    struct timespec start;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        lock();
        nvmlReturn_t r = NVML_ERROR_TIMEOUT;
        if (init_refs == 0) r = NVML_ERROR_UNINITIALIZED;
        else if (set_slot(set) < 0 || data == NULL) r = NVML_ERROR_INVALID_ARGUMENT;
        else {
            poll_events();
            if (set->count > 0) {
                *data = set->queue[set->head];
                set->head = (set->head + 1) % MAX_QUEUED;
                set->count--;
                r = NVML_SUCCESS;
            }
        }
        unlock();
        if (r != NVML_ERROR_TIMEOUT) return r;
        long long left = (long long)timeoutms - milliseconds_since(&start);
        if (left <= 0) return NVML_ERROR_TIMEOUT;
        struct timespec step = {0, (left < WAIT_STEP_MS ? left : WAIT_STEP_MS) * 1000000L};
        nanosleep(&step, NULL);
    }
}

/* The version before MIG; same signature and layout. */
nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    return nvmlEventSetWait_v2(set, data, timeoutms);
}

/* Device facts NVIDIA's DRA driver reads while it enumerates the GPUs: an Ampere board of
 * brand NVIDIA, no MIG. */
nvmlReturn_t nvmlDeviceGetArchitecture(nvmlDevice_t d, unsigned int *arch) {
    nvmlReturn_t r = check(d, arch, "nvmlDeviceGetArchitecture");
    if (r == NVML_SUCCESS) *arch = 7; /* NVML_DEVICE_ARCH_AMPERE */
    return r;
}

nvmlReturn_t nvmlDeviceGetBrand(nvmlDevice_t d, int *brand) {
    nvmlReturn_t r = check(d, brand, "nvmlDeviceGetBrand");
    if (r == NVML_SUCCESS) *brand = 14; /* NVML_BRAND_NVIDIA */
    return r;
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t d, unsigned int *current, unsigned int *pending) {
    nvmlReturn_t r = check(d, current, "nvmlDeviceGetMigMode");
    if (r != NVML_SUCCESS) return r;
    (void)pending;
    return NVML_ERROR_NOT_SUPPORTED;
}

nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t d, unsigned int *is_mig) {
    nvmlReturn_t r = check(d, is_mig, "nvmlDeviceIsMigDeviceHandle");
    if (r == NVML_SUCCESS) *is_mig = 0;
    return r;
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version) {
    if (version == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *version = 12080;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *version) {
    return nvmlSystemGetCudaDriverVersion(version);
}

/* No MIG: every GPU instance profile is unsupported. */
nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t d, unsigned int profile, void *info) {
    nvmlReturn_t r = check(d, info, "nvmlDeviceGetGpuInstanceProfileInfo");
    (void)profile;
    return r == NVML_SUCCESS ? NVML_ERROR_NOT_SUPPORTED : r;
}

nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoV(nvmlDevice_t d, unsigned int profile, void *info) {
    return nvmlDeviceGetGpuInstanceProfileInfo(d, profile, info);
}
