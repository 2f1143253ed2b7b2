// The AdamW step's CUDA handler; CUDA-graph compatible.
#include "ffi/adamw.h"
#include "nodrop/engine_cuda.h"

namespace nodrop::handlers {
namespace {

ffi::Error AdamWUpdate(cudaStream_t stream, ffi::Buffer<ffi::F32> param,
                       ffi::AnyBuffer grad, ffi::Buffer<ffi::F32> mu,
                       ffi::Buffer<ffi::F32> nu, ffi::Buffer<ffi::F32> scalars,
                       ffi::Result<ffi::Buffer<ffi::F32>> param_out,
                       ffi::Result<ffi::Buffer<ffi::F32>> mu_out,
                       ffi::Result<ffi::Buffer<ffi::F32>> nu_out,
                       ffi::Result<ffi::Buffer<ffi::F32>> partials, AdamWAttributes attributes) {
  auto config = decode_adamw(param, grad, mu, nu, scalars, *param_out, *mu_out, *nu_out,
                             *partials, attributes);
  if (!config) return config.error();
  return to_ffi_error(cuda::adamw_update(
      param.typed_data(), grad.untyped_data(), *float_dtype(grad.element_type()),
      mu.typed_data(), nu.typed_data(), scalars.typed_data(), *config, param_out->typed_data(),
      mu_out->typed_data(), nu_out->typed_data(), partials->typed_data(), stream));
}

}  // namespace

using Stream = ffi::PlatformStream<cudaStream_t>;

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropAdamWUpdateCuda, AdamWUpdate,
                              bind_adamw(ffi::Ffi::Bind().Ctx<Stream>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace nodrop::handlers
