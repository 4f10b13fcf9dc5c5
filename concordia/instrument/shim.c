/*
 * Concordia's module-loading shim, loaded with LD_PRELOAD.
 *
 * It intercepts the CUDA driver's module loaders (cuModuleLoadData,
 * cuModuleLoadDataEx, cuLibraryLoadData) whether they are called by name or
 * obtained through cuGetProcAddress (how the CUDA runtime and many frameworks
 * resolve driver entry points), and looks at each image:
 *
 *   PTX text           rewritten by `python -m concordia.instrument`
 *                      (input in a temporary file, output on a pipe) and the
 *                      rewritten text is loaded instead;
 *   fatbin (0xBA55ED50) its PTX members (zstd or LZ4 compressed ones are
 *                      inflated when libzstd / liblz4 can be opened) are
 *                      rewritten and tried newest architecture first; when none
 *                      loads, or there is none, the original image is loaded and
 *                      the module is reported as SASS only, by kernel name;
 *   ELF cubin          loaded as is and reported as SASS only, by kernel name.
 *
 * Every decision is appended as one JSON line to $CONCORDIA_SHIM_REPORT.
 * Environment: CONCORDIA_SHIM_PYTHON (interpreter, default python3),
 * CONCORDIA_SHIM_ARGS (extra rewriter arguments, e.g. "--track-stores"),
 * CONCORDIA_SHIM_FATBIN=0 (report fatbins only, never replace them).
 * Any failure of the rewriter leaves the original image in place.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

typedef int CUresult;
typedef void *CUmodule;
typedef void *CUlibrary;

#define FATBIN_MAGIC 0xBA55ED50u
#define FATBIN_WRAPPER_MAGIC 0x466243B1u
#define KIND_PTX 1
#define KIND_ELF 2
#define FLAG_LZ4 0x2000u
#define FLAG_ZSTD 0x8000u

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static void *libcuda;
static CUresult (*real_load)(CUmodule *, const void *);
static CUresult (*real_load_ex)(CUmodule *, const void *, unsigned, void *, void **);
static CUresult (*real_lib_load)(CUlibrary *, const void *, void *, void **, unsigned, void *, void **, unsigned);
static CUresult (*real_gpa)(const char *, void **, int, unsigned long long);
static CUresult (*real_gpa2)(const char *, void **, int, unsigned long long, void *);
static __thread int busy; /* our own loads must not recurse into the hooks */

/* ---------- report ---------- */

static void json_str(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        if (*s == '"' || *s == '\\') fputc('\\', f);
        if ((unsigned char)*s < 0x20) fprintf(f, "\\u%04x", *s); else fputc(*s, f);
    }
    fputc('"', f);
}

static void report(const char *via, const char *what, const char *detail, const char *names) {
    const char *path = getenv("CONCORDIA_SHIM_REPORT");
    if (!path || !*path) return;
    pthread_mutex_lock(&lock);
    FILE *f = fopen(path, "a");
    if (f) {
        fprintf(f, "{\"pid\": %d, \"via\": ", (int)getpid()); json_str(f, via);
        fprintf(f, ", \"action\": "); json_str(f, what);
        fprintf(f, ", \"detail\": "); json_str(f, detail ? detail : "");
        fprintf(f, ", \"kernels\": "); json_str(f, names ? names : "");
        fprintf(f, "}\n");
        fclose(f);
    }
    pthread_mutex_unlock(&lock);
}

/* ---------- image classification ---------- */

/* Kernel names of an ELF cubin: section names ".text.<kernel>". */
static void elf_kernels(const unsigned char *p, size_t n, char *out, size_t cap) {
    out[0] = 0;
    if (n < 64 || memcmp(p, "\x7f" "ELF", 4) != 0 || p[4] != 2) return;
    uint64_t shoff; uint16_t shentsize, shnum, shstrndx;
    memcpy(&shoff, p + 0x28, 8); memcpy(&shentsize, p + 0x3A, 2);
    memcpy(&shnum, p + 0x3C, 2); memcpy(&shstrndx, p + 0x3E, 2);
    if (shoff + (uint64_t)shnum * shentsize > n || shstrndx >= shnum) return;
    uint64_t stroff; memcpy(&stroff, p + shoff + (uint64_t)shstrndx * shentsize + 0x18, 8);
    size_t len = 0;
    for (unsigned i = 0; i < shnum; i++) {
        uint32_t name; memcpy(&name, p + shoff + (uint64_t)i * shentsize, 4);
        if (stroff + name >= n) continue;
        const char *s = (const char *)p + stroff + name;
        if (strncmp(s, ".text.", 6) == 0) {
            size_t k = strnlen(s + 6, n - stroff - name - 6);
            if (len + k + 2 >= cap) break;
            if (len) out[len++] = ',';
            memcpy(out + len, s + 6, k); len += k; out[len] = 0;
        }
    }
}

static int looks_like_ptx(const char *s) {
    size_t i = 0;
    while (i < 4096 && s[i] && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r')) i++;
    if (!s[i]) return 0;
    if (s[i] != '/' && s[i] != '.') return 0;
    return memmem(s, strnlen(s, 1 << 20), ".version", 8) != NULL &&
           memmem(s, strnlen(s, 1 << 20), ".target", 7) != NULL;
}

struct member { int kind; unsigned arch; unsigned flags; const unsigned char *data; uint64_t size, raw_size, packed; };

/* Members of a fatbin at p; returns the count (at most cap), -1 if not a fatbin. */
static int fatbin_members(const unsigned char *p, struct member *m, int cap, uint64_t *total) {
    uint32_t magic; memcpy(&magic, p, 4);
    if (magic != FATBIN_MAGIC) return -1;
    uint16_t hsize; uint64_t fsize;
    memcpy(&hsize, p + 6, 2); memcpy(&fsize, p + 8, 8);
    *total = hsize + fsize;
    uint64_t off = hsize;
    int k = 0;
    while (off + 64 <= hsize + fsize && k < cap) {
        const unsigned char *e = p + off;
        uint16_t kind; uint32_t ehs; uint64_t psz;
        memcpy(&kind, e, 2); memcpy(&ehs, e + 4, 4); memcpy(&psz, e + 8, 8);
        if (ehs < 64 || psz == 0) break;
        m[k].kind = kind; m[k].data = e + ehs; m[k].size = psz;
        memcpy(&m[k].arch, e + 28, 4); memcpy(&m[k].flags, e + 40, 4);
        m[k].raw_size = 0;
        if (ehs >= 64) memcpy(&m[k].raw_size, e + 56, 8);
        /* a compressed payload is padded to 8 bytes; its own length is at +16 */
        memcpy(&m[k].packed, e + 16, 8);
        if (m[k].packed == 0 || m[k].packed > psz) m[k].packed = psz;
        k++;
        off += ehs + psz;
    }
    return k;
}

/* Inflate a compressed PTX member; NULL (with why) when it cannot. */
static char *inflate(const struct member *m, const char **why) {
    uint64_t cap = m->raw_size ? m->raw_size : m->size * 16;
    char *out = calloc(1, cap + 1);
    if (!out) { *why = "out of memory"; return NULL; }
    if (m->flags & FLAG_ZSTD) {
        void *z = dlopen("libzstd.so.1", RTLD_NOW | RTLD_LOCAL);
        size_t (*dec)(void *, size_t, const void *, size_t) = z ? dlsym(z, "ZSTD_decompress") : NULL;
        unsigned (*iserr)(size_t) = z ? dlsym(z, "ZSTD_isError") : NULL;
        if (!dec || !iserr) { free(out); *why = "zstd-compressed PTX and libzstd.so.1 is not available"; return NULL; }
        size_t r = dec(out, cap, m->data, m->packed);
        if (iserr(r)) { free(out); *why = "zstd-compressed PTX did not inflate"; return NULL; }
        out[r] = 0;
        return out;
    }
    if (m->flags & FLAG_LZ4) {
        void *z = dlopen("liblz4.so.1", RTLD_NOW | RTLD_LOCAL);
        int (*dec)(const char *, char *, int, int) = z ? dlsym(z, "LZ4_decompress_safe") : NULL;
        if (!dec) { free(out); *why = "LZ4-compressed PTX and liblz4.so.1 is not available"; return NULL; }
        int r = dec((const char *)m->data, out, (int)m->packed, (int)cap);
        if (r < 0) { free(out); *why = "LZ4-compressed PTX did not inflate"; return NULL; }
        out[r] = 0;
        return out;
    }
    memcpy(out, m->data, m->size);
    out[m->size] = 0;
    return out;
}

/* One line describing the image, for tests and the report:
 * "ptx", "elf:<kernels>", "fatbin:ptx=<n>,compressed=<n>,elf=<n>:<kernels>", "unknown". */
int concordia_shim_classify(const void *image, char *out, size_t cap) {
    const unsigned char *p = image;
    uint32_t magic; memcpy(&magic, p, 4);
    if (magic == FATBIN_WRAPPER_MAGIC) { const void *d; memcpy(&d, p + 8, sizeof d); p = d; memcpy(&magic, p, 4); }
    if (memcmp(p, "\x7f" "ELF", 4) == 0) {
        char names[2048]; elf_kernels(p, 1 << 30, names, sizeof names);
        return snprintf(out, cap, "elf:%s", names);
    }
    struct member m[64]; uint64_t total;
    int k = fatbin_members(p, m, 64, &total);
    if (k >= 0) {
        int ptx = 0, comp = 0, elf = 0; char names[2048] = "";
        for (int i = 0; i < k; i++) {
            if (m[i].kind == KIND_PTX) { ptx++; if (m[i].flags & (FLAG_ZSTD | FLAG_LZ4)) comp++; }
            if (m[i].kind == KIND_ELF) { elf++; if (!names[0]) elf_kernels(m[i].data, m[i].size, names, sizeof names); }
        }
        return snprintf(out, cap, "fatbin:ptx=%d,compressed=%d,elf=%d:%s", ptx, comp, elf, names);
    }
    if (looks_like_ptx((const char *)p)) return snprintf(out, cap, "ptx");
    return snprintf(out, cap, "unknown");
}

/* ---------- the rewriter process ---------- */

extern char **environ;

/* Rewritten PTX (malloc'd) or NULL; *why says why not. */
static char *run_rewriter(const char *ptx, const char **why) {
    char in_path[] = "/tmp/concordia-ptx-XXXXXX";
    int in = mkstemp(in_path);
    if (in < 0) { *why = "cannot create a temporary file"; return NULL; }
    size_t n = strlen(ptx);
    if (write(in, ptx, n) != (ssize_t)n) { close(in); unlink(in_path); *why = "cannot write the temporary file"; return NULL; }
    lseek(in, 0, SEEK_SET);
    int pipefd[2];
    if (pipe(pipefd) != 0) { close(in); unlink(in_path); *why = "pipe failed"; return NULL; }
    pid_t pid = fork();
    if (pid == 0) {
        dup2(in, 0); dup2(pipefd[1], 1);
        close(pipefd[0]); close(pipefd[1]); close(in);
        unsetenv("LD_PRELOAD");
        const char *py = getenv("CONCORDIA_SHIM_PYTHON");
        const char *extra = getenv("CONCORDIA_SHIM_ARGS");
        const char *rep = getenv("CONCORDIA_SHIM_REPORT");
        char *argv[16]; int a = 0;
        argv[a++] = (char *)(py && *py ? py : "python3");
        argv[a++] = "-m"; argv[a++] = "concordia.instrument";
        if (rep && *rep) { argv[a++] = "--report"; argv[a++] = (char *)rep; }
        char extra_buf[256] = "";
        if (extra && *extra) {
            snprintf(extra_buf, sizeof extra_buf, "%s", extra);
            for (char *t = strtok(extra_buf, " "); t && a < 14; t = strtok(NULL, " ")) argv[a++] = t;
        }
        argv[a] = NULL;
        execvp(argv[0], argv);
        _exit(127);
    }
    close(pipefd[1]); close(in); unlink(in_path);
    if (pid < 0) { close(pipefd[0]); *why = "fork failed"; return NULL; }
    size_t cap = n * 2 + 65536, len = 0;
    char *out = malloc(cap + 1);
    for (;;) {
        if (len == cap) { cap *= 2; out = realloc(out, cap + 1); }
        ssize_t r = read(pipefd[0], out + len, cap - len);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        len += (size_t)r;
    }
    close(pipefd[0]);
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || len == 0) {
        free(out);
        *why = WIFEXITED(status) && WEXITSTATUS(status) == 3 ? "rewriter left the module alone"
             : "rewriter failed (is concordia importable by CONCORDIA_SHIM_PYTHON?)";
        return NULL;
    }
    out[len] = 0;
    return out;
}

/* ---------- resolution of the real entry points ---------- */

/* glibc's own dlsym: this library exports a dlsym of its own (below). */
static void *(*real_dlsym)(void *, const char *);

static void *next_dlsym(void *handle, const char *name) {
    if (!real_dlsym) {
        real_dlsym = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
        if (!real_dlsym) real_dlsym = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    }
    return real_dlsym ? real_dlsym(handle, name) : NULL;
}

static void *cuda_sym(const char *name) {
    if (!libcuda) {
        libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
        if (!libcuda) libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    }
    return libcuda ? next_dlsym(libcuda, name) : NULL;
}

static void resolve(void) {
    if (!real_load) real_load = cuda_sym("cuModuleLoadData");
    if (!real_load_ex) real_load_ex = cuda_sym("cuModuleLoadDataEx");
    if (!real_lib_load) real_lib_load = cuda_sym("cuLibraryLoadData");
    if (!real_gpa) real_gpa = cuda_sym("cuGetProcAddress");
    if (!real_gpa2) real_gpa2 = cuda_sym("cuGetProcAddress_v2");
}

/* Decide what to load for `image`: a malloc'd replacement (caller frees and
 * loads it, falling back to the original on failure) or NULL (load original).
 * For fatbins several candidates may exist; `skip` selects the next one. */
static char *replacement(const void *image, const char *via, int skip) {
    if (getenv("CONCORDIA_SHIM_DISABLE")) return NULL;
    const unsigned char *p = image;
    uint32_t magic; memcpy(&magic, p, 4);
    if (magic == FATBIN_WRAPPER_MAGIC) { const void *d; memcpy(&d, p + 8, sizeof d); p = d; memcpy(&magic, p, 4); }
    const char *why = NULL;
    if (memcmp(p, "\x7f" "ELF", 4) == 0) {
        if (skip == 0) { char names[2048]; elf_kernels(p, 1 << 30, names, sizeof names);
            report(via, "sass-only", "ELF cubin: no PTX to instrument", names); }
        return NULL;
    }
    struct member m[64]; uint64_t total;
    int k = fatbin_members(p, m, 64, &total);
    if (k >= 0) {
        const char *fb = getenv("CONCORDIA_SHIM_FATBIN");
        char names[2048] = "";
        for (int i = 0; i < k; i++) if (m[i].kind == KIND_ELF && !names[0]) elf_kernels(m[i].data, m[i].size, names, sizeof names);
        int order[64], n = 0;
        for (int i = 0; i < k; i++) if (m[i].kind == KIND_PTX) order[n++] = i;
        for (int a = 0; a < n; a++) for (int b = a + 1; b < n; b++)  /* newest PTX first */
            if (m[order[b]].arch > m[order[a]].arch) { int t = order[a]; order[a] = order[b]; order[b] = t; }
        if (n == 0) { if (skip == 0) report(via, "sass-only", "fatbin without PTX", names); return NULL; }
        if (fb && strcmp(fb, "0") == 0) { if (skip == 0) report(via, "skipped", "fatbin PTX use disabled", names); return NULL; }
        if (skip >= n) { report(via, "skipped", "no PTX member of the fatbin could be rewritten and loaded", names); return NULL; }
        char *text = inflate(&m[order[skip]], &why);
        if (!text) { report(via, "skipped", why, names); return NULL; }
        char *out = run_rewriter(text, &why);
        free(text);
        if (!out) report(via, "skipped", why, names);
        else report(via, "instrumented", "fatbin PTX member", "");
        return out;
    }
    if (skip == 0 && looks_like_ptx((const char *)p)) {
        char *out = run_rewriter((const char *)p, &why);
        if (!out) report(via, "skipped", why, "");
        else report(via, "instrumented", "PTX", "");
        return out;
    }
    return NULL;
}

/* ---------- the hooks ---------- */

CUresult cuModuleLoadData(CUmodule *mod, const void *image) {
    resolve();
    if (!real_load) return 999; /* CUDA_ERROR_UNKNOWN */
    if (busy || !image) return real_load(mod, image);
    busy = 1;
    CUresult r = 1;
    for (int skip = 0; ; skip++) {
        char *alt = replacement(image, "cuModuleLoadData", skip);
        if (!alt) { r = real_load(mod, image); break; }
        r = real_load(mod, alt);
        free(alt);
        if (r == 0) break;
        report("cuModuleLoadData", "load-failed", "rewritten image refused by the driver; trying the next", "");
    }
    busy = 0;
    return r;
}

CUresult cuModuleLoadDataEx(CUmodule *mod, const void *image, unsigned n, void *opts, void **vals) {
    resolve();
    if (!real_load_ex) return 999;
    if (busy || !image) return real_load_ex(mod, image, n, opts, vals);
    busy = 1;
    CUresult r = 1;
    for (int skip = 0; ; skip++) {
        char *alt = replacement(image, "cuModuleLoadDataEx", skip);
        if (!alt) { r = real_load_ex(mod, image, n, opts, vals); break; }
        r = real_load_ex(mod, alt, n, opts, vals);
        free(alt);
        if (r == 0) break;
        report("cuModuleLoadDataEx", "load-failed", "rewritten image refused by the driver; trying the next", "");
    }
    busy = 0;
    return r;
}

CUresult cuLibraryLoadData(CUlibrary *lib, const void *code, void *jo, void **jv, unsigned jn,
                           void *lo, void **lv, unsigned ln) {
    resolve();
    if (!real_lib_load) return 999;
    if (busy || !code) return real_lib_load(lib, code, jo, jv, jn, lo, lv, ln);
    busy = 1;
    CUresult r = 1;
    for (int skip = 0; ; skip++) {
        char *alt = replacement(code, "cuLibraryLoadData", skip);
        if (!alt) { r = real_lib_load(lib, code, jo, jv, jn, lo, lv, ln); break; }
        r = real_lib_load(lib, alt, jo, jv, jn, lo, lv, ln);
        free(alt);
        if (r == 0) break;
        report("cuLibraryLoadData", "load-failed", "rewritten image refused by the driver; trying the next", "");
    }
    busy = 0;
    return r;
}

/* Entry points handed out through cuGetProcAddress are swapped for ours. */
static void swap(const char *symbol, void **pfn) {
    if (!pfn || !*pfn) return;
    if (*pfn == (void *)cuModuleLoadData || *pfn == (void *)cuModuleLoadDataEx ||
        *pfn == (void *)cuLibraryLoadData) return;
    if (strcmp(symbol, "cuModuleLoadData") == 0) { if (!real_load) real_load = *pfn; *pfn = (void *)cuModuleLoadData; }
    else if (strcmp(symbol, "cuModuleLoadDataEx") == 0) { if (!real_load_ex) real_load_ex = *pfn; *pfn = (void *)cuModuleLoadDataEx; }
    else if (strcmp(symbol, "cuLibraryLoadData") == 0) { if (!real_lib_load) real_lib_load = *pfn; *pfn = (void *)cuLibraryLoadData; }
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int ver, unsigned long long flags) {
    resolve();
    if (!real_gpa) return 999;
    CUresult r = real_gpa(symbol, pfn, ver, flags);
    if (r == 0) swap(symbol, pfn);
    return r;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int ver, unsigned long long flags, void *status) {
    resolve();
    if (!real_gpa2) return 999;
    CUresult r = real_gpa2(symbol, pfn, ver, flags, status);
    if (r == 0) swap(symbol, pfn);
    return r;
}

/* Loaders that open libcuda themselves and look entry points up with
 * dlsym(handle, ...) (cuda-bindings, the CUDA runtime) never see LD_PRELOAD's
 * symbol order, so the lookup itself hands out our entry points. */
void *dlsym(void *handle, const char *name) {
    void *p = next_dlsym(handle, name);
    if (!p || strncmp(name, "cu", 2) != 0) return p;
    if (strcmp(name, "cuGetProcAddress") == 0 && p != (void *)cuGetProcAddress) {
        if (!real_gpa) real_gpa = p;
        return (void *)cuGetProcAddress;
    }
    if (strcmp(name, "cuGetProcAddress_v2") == 0 && p != (void *)cuGetProcAddress_v2) {
        if (!real_gpa2) real_gpa2 = p;
        return (void *)cuGetProcAddress_v2;
    }
    void *q = p;
    swap(name, &q);
    return q;
}

/* ---------- the CUDA runtime's own registrations ---------- */

/* Kernel names of a fatbin's first ELF member, inflated when compressed. */
static void fatbin_kernel_names(const void *image, char *out, size_t cap) {
    const unsigned char *p = image;
    uint32_t magic; memcpy(&magic, p, 4);
    out[0] = 0;
    if (magic == FATBIN_WRAPPER_MAGIC) { const void *d; memcpy(&d, p + 8, sizeof d); p = d; }
    struct member m[64]; uint64_t total;
    int k = fatbin_members(p, m, 64, &total);
    for (int i = 0; i < k && !out[0]; i++) {
        if (m[i].kind != KIND_ELF) continue;
        if (!(m[i].flags & (FLAG_ZSTD | FLAG_LZ4))) { elf_kernels(m[i].data, m[i].size, out, cap); continue; }
        const char *why = NULL;
        char *raw = inflate(&m[i], &why);
        if (!raw) continue;
        elf_kernels((const unsigned char *)raw, m[i].raw_size ? m[i].raw_size : m[i].size * 16, out, cap);
        free(raw);
    }
}

/* Libraries built by nvcc (libtorch among them) register each embedded fatbin
 * with the CUDA runtime when they are loaded; the runtime then loads the
 * modules through interfaces of its own, which the loaders above never see.
 * Where the runtime is a shared libcudart, the registration passes through
 * here and each fatbin is reported with its kernels' names.  It is not
 * rewritten: the runtime keeps the address it was given, and JIT-compiling the
 * PTX of a library of thousands of kernels would take minutes at start-up. */
void **__cudaRegisterFatBinary(void *fat) {
    static void **(*real)(void *);
    if (!real) real = (void **(*)(void *))next_dlsym(RTLD_NEXT, "__cudaRegisterFatBinary");
    const char *path = getenv("CONCORDIA_SHIM_REPORT");
    if (fat && path && *path && !getenv("CONCORDIA_SHIM_DISABLE")) {
        char desc[512], names[2048];
        concordia_shim_classify(fat, desc, sizeof desc);
        char *colon = strchr(desc + (strncmp(desc, "fatbin:", 7) == 0 ? 7 : 0), ':');
        if (colon) *colon = 0;  /* the member counts; the names come next, inflated if need be */
        fatbin_kernel_names(fat, names, sizeof names);
        report("__cudaRegisterFatBinary", "registered", desc, names);
    }
    return real ? real(fat) : NULL;
}
