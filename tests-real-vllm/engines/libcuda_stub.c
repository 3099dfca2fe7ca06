/* A libcuda.so.1 for a machine without a CUDA driver, written for `nox -s real_sglang`.
 *
 * sglang-kernel's extension modules are linked against libcuda.so.1, so importing sglang
 * fails on a machine without the NVIDIA driver before SGLang ever gets to its CPU engine.
 * This library has the driver entry points those modules name (nm -D --undefined-only
 * sgl_kernel/ (asterisk).so) plus the ones CUDA runtimes call first; every one of them
 * answers that there is no device, so nothing ever runs on a GPU. Built at session time:
 *
 *     cc -shared -fPIC -o DIR/libcuda.so.1 libcuda_stub.c
 */

#include <stddef.h>

typedef int CUresult;
#define CUDA_ERROR_NO_DEVICE 100
#define CUDA_ERROR_NOT_FOUND 500

static const char no_device[] = "no CUDA device (llmgw's libcuda stub: this node has no driver)";

CUresult cuInit(unsigned int flags) { (void)flags; return CUDA_ERROR_NO_DEVICE; }

CUresult cuDriverGetVersion(int *version) {
    if (version) *version = 0;
    return CUDA_ERROR_NO_DEVICE;
}

CUresult cuDeviceGetCount(int *count) {
    if (count) *count = 0;
    return CUDA_ERROR_NO_DEVICE;
}

CUresult cuGetErrorString(CUresult error, const char **text) {
    (void)error;
    if (text) *text = no_device;
    return 0;
}

CUresult cuGetErrorName(CUresult error, const char **text) {
    (void)error;
    if (text) *text = "CUDA_ERROR_NO_DEVICE";
    return 0;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version,
                             unsigned long long flags, int *status) {
    (void)symbol; (void)version; (void)flags;
    if (pfn) *pfn = NULL;
    if (status) *status = 1; /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
    return CUDA_ERROR_NOT_FOUND;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int version,
                          unsigned long long flags) {
    return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}

/* The rest of what sgl_kernel links: never reached without a device, refused if it is. */
#define NO_DEVICE(name) CUresult name(void) { return CUDA_ERROR_NO_DEVICE; }
NO_DEVICE(cuCtxFromGreenCtx)
NO_DEVICE(cuCtxPopCurrent_v2)
NO_DEVICE(cuCtxPushCurrent_v2)
NO_DEVICE(cuDevResourceGenerateDesc)
NO_DEVICE(cuDevSmResourceSplitByCount)
NO_DEVICE(cuDeviceGetDevResource)
NO_DEVICE(cuGreenCtxCreate)
NO_DEVICE(cuGreenCtxDestroy)
NO_DEVICE(cuGreenCtxGetDevResource)
NO_DEVICE(cuPointerGetAttribute)
NO_DEVICE(cuStreamCreate)
NO_DEVICE(cuDeviceGet)
NO_DEVICE(cuCtxGetCurrent)
