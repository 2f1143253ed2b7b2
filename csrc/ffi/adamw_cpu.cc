// The AdamW step's CPU handler, on XLA's thread pool.
#include "ffi/adamw.h"
#include "ffi/xla_thread_pool.h"
#include "nodrop/engine_cpu.h"

namespace nodrop::handlers {
namespace {

ffi::Error AdamWUpdate(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> param,
                       ffi::AnyBuffer grad, ffi::Buffer<ffi::F32> mu,
                       ffi::Buffer<ffi::F32> nu, ffi::Buffer<ffi::F32> scalars,
                       ffi::Result<ffi::Buffer<ffi::F32>> param_out,
                       ffi::Result<ffi::Buffer<ffi::F32>> mu_out,
                       ffi::Result<ffi::Buffer<ffi::F32>> nu_out,
                       ffi::Result<ffi::Buffer<ffi::F32>> partials, AdamWAttributes attributes) {
  auto config = decode_adamw(param, grad, mu, nu, scalars, *param_out, *mu_out, *nu_out,
                             *partials, attributes);
  if (!config) return config.error();
  XlaThreadPoolRunner runner(pool);
  return to_ffi_error(cpu::adamw_update(
      param.typed_data(), grad.untyped_data(), *float_dtype(grad.element_type()),
      mu.typed_data(), nu.typed_data(), scalars.typed_data(), *config, param_out->typed_data(),
      mu_out->typed_data(), nu_out->typed_data(), partials->typed_data(), &runner));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropAdamWUpdateCpu, AdamWUpdate,
                              bind_adamw(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

}  // namespace nodrop::handlers
