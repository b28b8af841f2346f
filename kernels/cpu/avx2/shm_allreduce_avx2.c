/* The shared-memory collectives (plain C) in the AVX2 library too: tensor-parallel ranks on CPUs without
 * AVX-512 reduce through the same segment protocol (kernels/cpu/shm_allreduce.h). */
#include "../shm_allreduce.c"
