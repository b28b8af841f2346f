/* AMX (Advanced Matrix Extensions) support shared by every AMX kernel (gemm_packed_amx.h, gemm_quant_amx.h,
 * attend_amx.h, attend_decode_amx.h): the one-time probe, loading a tile configuration, releasing the tiles.
 *
 * amx_ready(): CPUID has AMX-TILE and AMX-BF16, the kernel granted this process tile data (arch_prctl
 * ARCH_REQ_XCOMP_PERM, asked once per process), and XLLM_AMX is not "0". amx_int8_ready(): the same and
 * CPUID has AMX-INT8 (gemm_w8a8_amx.h). The probe runs once (pthread_once); its results never change
 * afterwards.
 * amx_load_config(cfg): loads any configuration (attend_decode_amx.h builds its own); amx_tile_release()
 * gives the tiles back at the end of a kernel's work on a thread.
 * amx_configure_16x64(n): loads palette 1 with tiles 0..n-1 each 16 rows x 64 bytes (the shape the other
 * kernels use: C 16 x 16 fp32, A 16 x 32 bf16, B 16 k-pairs x 16 x 2 bf16). A kernel loads it at the start
 * of its call on every thread and releases the tiles at the end (oneDNN, in the same process, uses AMX
 * with its own configurations).
 */
#ifndef XLLM_CPU_AMX_H
#define XLLM_CPU_AMX_H

#include <cpuid.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <immintrin.h>

#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))
#define AMX_INT8_TARGET __attribute__((target("amx-tile,amx-bf16,amx-int8")))

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} AmxTileCfg;

static pthread_once_t amx_once = PTHREAD_ONCE_INIT;
static int amx_ok = 0, amx_int8_ok = 0; /* written once, under amx_once */

static void amx_probe(void) {
    const char *env = getenv("XLLM_AMX");
    if (env != NULL && env[0] == '0') return;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return;
    if (!((d >> 22) & 1) || !((d >> 24) & 1)) return; /* AMX-BF16, AMX-TILE */
    /* ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18) */
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return;
    amx_ok = 1;
    amx_int8_ok = (d >> 25) & 1; /* AMX-INT8 */
}

/* whether AMX kernels can run in this process (probed once) */
static inline int amx_ready(void) {
    pthread_once(&amx_once, amx_probe);
    return amx_ok;
}

/* whether the AMX-INT8 kernels can run in this process (probed once) */
static inline int amx_int8_ready(void) {
    pthread_once(&amx_once, amx_probe);
    return amx_int8_ok;
}

/* loads a tile configuration. Not _tile_loadconfig: GCC 12 declares its operand as an 8-byte read, so once
 * inlined (into an OpenMP region) the stores of the other 56 bytes may be dropped as dead and ldtilecfg
 * faults on a garbage configuration (seen in a standalone test program); this asm reads the whole struct. */
AMX_TARGET static inline void amx_load_config(const AmxTileCfg *cfg) { __asm__ volatile("ldtilecfg %0" : : "m"(*cfg)); }

AMX_TARGET static inline void amx_configure_16x64(int n_tiles) {
    AmxTileCfg cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int t = 0; t < n_tiles; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    amx_load_config(&cfg);
}

/* releases the tiles (the end of an AMX kernel's work on this thread) */
AMX_TARGET static inline void amx_tile_release(void) { _tile_release(); }

#endif
