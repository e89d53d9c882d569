// The SM architectures this build's kernels were compiled for, for `python -m pycomm.env`.
// nvcc (11.5 and later) defines __CUDA_ARCH_LIST__ in the host pass too, e.g. 800,900.
// Variadic: the list holds commas.
#define PYCOMM_STR2(...) #__VA_ARGS__
#define PYCOMM_STR(...) PYCOMM_STR2(__VA_ARGS__)

namespace pycomm {
namespace cuda {

const char* arch_list() {
#ifdef __CUDA_ARCH_LIST__
  return PYCOMM_STR(__CUDA_ARCH_LIST__);
#else
  return "unknown";
#endif
}

}  // namespace cuda
}  // namespace pycomm
