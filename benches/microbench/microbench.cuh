// Shared by the standalone microbenchmarks of this folder (each compiled on its own with nvcc on the GPU
// machine): the CUDA error check and the event timing of a repeated launch.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#define CK(x)                                                                 \
    do {                                                                      \
        cudaError_t e = (x);                                                  \
        if (e != cudaSuccess) {                                               \
            printf("%s: %s\n", #x, cudaGetErrorString(e));                    \
            exit(1);                                                          \
        }                                                                     \
    } while (0)

// Milliseconds per call of `launch` (which queues work on the default stream): three untimed calls, then
// the mean of `reps` calls between two events; any launch error ends the program.
template <class F>
float time_ms(F launch, int reps = 10) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int i = 0; i < 3; ++i) launch();
    CK(cudaEventRecord(a));
    for (int i = 0; i < reps; ++i) launch();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    CK(cudaGetLastError());
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    return ms / reps;
}
