/* Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as
 * 1, 2, 3"): a counter-based generator, so any element's random number is a
 * pure function of (seed, counter) and threads or GPUs agree bit for bit. */
#ifndef DS_PHILOX_H
#define DS_PHILOX_H

#include "ds_kview.h"

typedef struct { uint32_t v[4]; } ds_philox4;

DS_HOSTDEV ds_philox4 ds_philox4x32_10(ds_philox4 ctr, uint32_t k0, uint32_t k1) {
    for (int r = 0; r < 10; r++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * ctr.v[0];
        uint64_t p1 = (uint64_t)0xCD9E8D57u * ctr.v[2];
        ds_philox4 n;
        n.v[0] = (uint32_t)(p1 >> 32) ^ ctr.v[1] ^ k0;
        n.v[1] = (uint32_t)p1;
        n.v[2] = (uint32_t)(p0 >> 32) ^ ctr.v[3] ^ k1;
        n.v[3] = (uint32_t)p0;
        ctr = n;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return ctr;
}

/* Four uniform 32-bit words for block `block` of the stream `seed`. */
DS_HOSTDEV ds_philox4 ds_philox_block(uint64_t seed, uint64_t block) {
    ds_philox4 c = {{ (uint32_t)block, (uint32_t)(block >> 32), 0, 0 }};
    return ds_philox4x32_10(c, (uint32_t)seed, (uint32_t)(seed >> 32));
}

/* Uniform in (0, 1]: never 0, so log() in Box-Muller stays finite. */
DS_HOSTDEV float ds_u32_to_unit(uint32_t x) {
    return ((float)(x >> 8) + 1.0f) * (1.0f / 16777216.0f);
}

#endif
