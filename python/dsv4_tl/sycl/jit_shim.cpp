// C-ABI bridge from Python (ctypes) to Intel's SYCL runtime compiler (sycl-jit).
//
// No SYCL C++ compiler ships on PyPI, but Intel's SYCL runtime implements
// sycl_ext_oneapi_kernel_compiler: it compiles SYCL C++ free-function kernels from a source
// string with Intel's own device compiler. This file is built with plain g++ against the
// intel-sycl-rt wheel's headers (python -m dsv4_tl.sycl.jit build-shim) and does exactly one
// thing: source in, SPIR-V of the compiled device image out. Loading and launching the SPIR-V
// is dpctl's job (dsv4_tl.sycl.runtime), so artifacts never need this library again.
#include <sycl/sycl.hpp>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace syclexp = sycl::ext::oneapi::experimental;

namespace {

char *copy_string(const std::string &s) {
  char *out = static_cast<char *>(std::malloc(s.size() + 1));
  if (out) std::memcpy(out, s.c_str(), s.size() + 1);
  return out;
}

}  // namespace

extern "C" {

// queue_ref: a sycl::queue* (dpctl.SyclQueue.addressof_ref()); its context and device pick
// the compilation target. On success returns 0, *spirv/*spirv_len hold a malloc'ed copy of
// the device image and *log the compiler log. On failure returns 1 and *log holds the error.
// Free both with dsv4_sycl_free.
int dsv4_sycl_compile(void *queue_ref, const char *source, const char *const *options,
                      int num_options, void **spirv, size_t *spirv_len, char **log) {
  *spirv = nullptr;
  *spirv_len = 0;
  *log = nullptr;
  try {
    auto &queue = *static_cast<sycl::queue *>(queue_ref);
    std::vector<std::string> opts(options, options + num_options);
    std::string build_log;
    auto source_bundle = syclexp::create_kernel_bundle_from_source(
        queue.get_context(), syclexp::source_language::sycl, std::string(source));
    auto exe_bundle = syclexp::build(
        source_bundle, std::vector<sycl::device>{queue.get_device()},
        syclexp::properties{syclexp::build_options{opts}, syclexp::save_log{&build_log}});
    std::vector<std::byte> image;
    int images = 0;
    for (const auto &device_image : exe_bundle) {
      image = device_image.ext_oneapi_get_backend_content();
      ++images;
    }
    if (images != 1) {
      *log = copy_string("expected one device image, got " + std::to_string(images) + "\n" +
                         build_log);
      return 1;
    }
    *spirv = std::malloc(image.size());
    if (!*spirv) {
      *log = copy_string("out of host memory");
      return 1;
    }
    std::memcpy(*spirv, image.data(), image.size());
    *spirv_len = image.size();
    *log = copy_string(build_log);
    return 0;
  } catch (const std::exception &err) {
    *log = copy_string(err.what());
    return 1;
  }
}

void dsv4_sycl_free(void *ptr) { std::free(ptr); }

}  // extern "C"
