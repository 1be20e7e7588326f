// One XLA FFI custom call that launches a chain of compiled kernels (cubins) on its stream,
// each after the first optionally with programmatic dependent launch (Hopper's PDL): the next
// kernel's programs may be scheduled while the previous one drains, and wait for its writes
// with `griddepcontrol.wait`. XLA launches each Pallas kernel itself, with no way to ask for
// that; here the chain is one custom call, so the edges stay inside the one node that XLA's
// command buffer captures. Built by pallas_kernels/cubin_chain.py; GPU only.
//
// The kernels are registered once from Python (cubin_chain_register: image, name, shared
// memory) and named by id in the call's "program" attribute, a flat int64 array:
//   n, then per launch: id, grid x, y, z, threads, shared bytes, pdl, params, param[0..)
// where a param is the index of a buffer among the call's operands then results, or -1 for a
// null pointer (Triton's scratch pointers, unused by kernels without device-side TMA).
// The driver is opened with dlopen, so the library links against nothing of CUDA's.

#include <dlfcn.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <cuda.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Driver {
  decltype(&cuModuleLoadData) module_load_data = nullptr;
  decltype(&cuModuleGetFunction) module_get_function = nullptr;
  decltype(&cuFuncSetAttribute) func_set_attribute = nullptr;
  decltype(&cuLaunchKernelEx) launch_kernel_ex = nullptr;
  decltype(&cuCtxGetCurrent) ctx_get_current = nullptr;
  decltype(&cuGetErrorString) get_error_string = nullptr;
  std::string error;
};

template <typename F>
void Bind(void* lib, const char* name, F* fn, std::string* error) {
  *fn = reinterpret_cast<F>(dlsym(lib, name));
  if (*fn == nullptr && error->empty()) error->assign(std::string("libcuda lacks ") + name);
}

const Driver& GetDriver() {
  static const Driver* driver = [] {
    auto* d = new Driver;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      d->error = std::string("dlopen libcuda.so.1: ") + dlerror();
      return d;
    }
    Bind(lib, "cuModuleLoadData", &d->module_load_data, &d->error);
    Bind(lib, "cuModuleGetFunction", &d->module_get_function, &d->error);
    Bind(lib, "cuFuncSetAttribute", &d->func_set_attribute, &d->error);
    Bind(lib, "cuLaunchKernelEx", &d->launch_kernel_ex, &d->error);
    Bind(lib, "cuCtxGetCurrent", &d->ctx_get_current, &d->error);
    Bind(lib, "cuGetErrorString", &d->get_error_string, &d->error);
    return d;
  }();
  return *driver;
}

struct Image {
  std::string cubin, name;
  int64_t shared;
};

std::mutex mu;
std::vector<Image> images;                                  // by id
std::map<std::pair<CUcontext, int64_t>, CUfunction> loaded;  // a function per context

ffi::Error CudaError(const Driver& d, CUresult r, const std::string& what) {
  const char* s = nullptr;
  d.get_error_string(r, &s);
  return ffi::Error::Internal(what + ": " + (s ? s : "unknown CUDA error"));
}

// The kernel `id` in the current context, loaded on first use.
ffi::ErrorOr<CUfunction> Function(int64_t id) {
  const Driver& d = GetDriver();
  if (!d.error.empty()) return ffi::Error::Internal(d.error);
  CUcontext ctx = nullptr;
  if (CUresult r = d.ctx_get_current(&ctx); r != CUDA_SUCCESS)
    return CudaError(d, r, "cuCtxGetCurrent");
  std::lock_guard<std::mutex> lock(mu);
  if (id < 0 || id >= static_cast<int64_t>(images.size()))
    return ffi::Error::InvalidArgument("cubin_chain: unknown kernel id " + std::to_string(id));
  auto it = loaded.find({ctx, id});
  if (it != loaded.end()) return it->second;
  const Image& image = images[id];
  CUmodule module = nullptr;
  CUfunction fn = nullptr;
  if (CUresult r = d.module_load_data(&module, image.cubin.data()); r != CUDA_SUCCESS)
    return CudaError(d, r, "cuModuleLoadData " + image.name);
  if (CUresult r = d.module_get_function(&fn, module, image.name.c_str()); r != CUDA_SUCCESS)
    return CudaError(d, r, "cuModuleGetFunction " + image.name);
  // Past 48 KB a kernel gets dynamic shared memory only when it asks for it.
  if (image.shared > 49152) {
    CUresult r = d.func_set_attribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                      static_cast<int>(image.shared));
    if (r != CUDA_SUCCESS) return CudaError(d, r, "cuFuncSetAttribute " + image.name);
  }
  loaded[{ctx, id}] = fn;
  return fn;
}

// Walks the program, calling visit(id, header, params) for each launch; header is the six
// numbers after the id. Checks the layout against the number of buffers.
template <typename Visit>
ffi::Error Walk(ffi::Span<const int64_t> program, int64_t buffers, Visit visit) {
  size_t at = 0, size = program.size();
  auto bad = [&](const std::string& why) {
    return ffi::Error::InvalidArgument("cubin_chain: malformed program (" + why + ")");
  };
  if (size < 1) return bad("empty");
  int64_t n = program[at++];
  for (int64_t i = 0; i < n; ++i) {
    if (at + 8 > size) return bad("launch header past the end");
    int64_t id = program[at];
    const int64_t* header = &program[at + 1];
    int64_t count = program[at + 7];
    at += 8;
    if (count < 0 || at + count > size) return bad("params past the end");
    for (int64_t j = 0; j < count; ++j)
      if (program[at + j] < -1 || program[at + j] >= buffers) return bad("buffer index");
    if (ffi::Error e = visit(id, header, &program[at], count); e.failure()) return e;
    at += count;
  }
  if (at != size) return bad("trailing numbers");
  return ffi::Error::Success();
}

ffi::Error Initialize(ffi::Span<const int64_t> program) {
  return Walk(program, INT64_MAX, [](int64_t id, const int64_t*, const int64_t*, int64_t) {
    ffi::ErrorOr<CUfunction> fn = Function(id);
    return fn.has_error() ? fn.error() : ffi::Error::Success();
  });
}

ffi::Error Execute(CUstream stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                   ffi::Span<const int64_t> program) {
  std::vector<void*> buffers;
  for (size_t i = 0; i < args.size(); ++i) {
    ffi::ErrorOr<ffi::AnyBuffer> b = args.get<ffi::AnyBuffer>(i);
    if (b.has_error()) return b.error();
    buffers.push_back(b->untyped_data());
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> b = rets.get<ffi::AnyBuffer>(i);
    if (b.has_error()) return b.error();
    buffers.push_back((*b)->untyped_data());
  }
  const Driver& d = GetDriver();
  return Walk(program, static_cast<int64_t>(buffers.size()),
              [&](int64_t id, const int64_t* h, const int64_t* param, int64_t count) {
    ffi::ErrorOr<CUfunction> fn = Function(id);
    if (fn.has_error()) return fn.error();
    std::vector<void*> values(count), pointers(count);
    for (int64_t j = 0; j < count; ++j) {
      values[j] = param[j] < 0 ? nullptr : buffers[param[j]];
      pointers[j] = &values[j];
    }
    CUlaunchAttribute pdl = {};
    pdl.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    pdl.value.programmaticStreamSerializationAllowed = 1;
    CUlaunchConfig config = {};
    config.gridDimX = static_cast<unsigned>(h[0]);
    config.gridDimY = static_cast<unsigned>(h[1]);
    config.gridDimZ = static_cast<unsigned>(h[2]);
    config.blockDimX = static_cast<unsigned>(h[3]);
    config.blockDimY = config.blockDimZ = 1;
    config.sharedMemBytes = static_cast<unsigned>(h[4]);
    config.hStream = stream;
    config.attrs = h[5] ? &pdl : nullptr;
    config.numAttrs = h[5] ? 1 : 0;
    CUresult r = d.launch_kernel_ex(&config, *fn, pointers.data(), nullptr);
    if (r != CUDA_SUCCESS) return CudaError(d, r, "cuLaunchKernelEx " + images[id].name);
    return ffi::Error::Success();
  });
}

}  // namespace

extern "C" int64_t cubin_chain_register(const char* cubin, int64_t size, const char* name,
                                        int64_t shared) {
  std::lock_guard<std::mutex> lock(mu);
  images.push_back({std::string(cubin, size), name, shared});
  return static_cast<int64_t>(images.size()) - 1;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(cubin_chain_initialize, Initialize,
                              ffi::Ffi::BindInitialize().Attr<ffi::Span<const int64_t>>("program"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(cubin_chain_execute, Execute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("program"),
                              {ffi::Traits::kCmdBufferCompatible});
