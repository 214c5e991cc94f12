// split_bf16_remainder and join_bf16_remainder: dense tensors in any memory format, the outputs in
// the input's. CPU only: the optimizers use them once, when a param's master state is made.
#include "ops/remainder.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>

#include "common/registry.h"

namespace fusedamp {
namespace {

std::tuple<at::Tensor, at::Tensor> split_bf16_remainder(const at::Tensor& master) {
  TORCH_CHECK_TYPE(master.scalar_type() == at::kFloat, "fusedamp: split_bf16_remainder: master "
                   "must be float32, got ", master.scalar_type());
  const at::Tensor source = master.is_non_overlapping_and_dense() ? master : master.contiguous();
  at::Tensor param = at::empty_like(source, source.options().dtype(at::kBFloat16));
  at::Tensor remainder = at::empty_like(source, source.options().dtype(at::kShort));
  run_kernel(SplitRemainderCall{source.device(), source.const_data_ptr<float>(),
                                static_cast<uint16_t*>(param.data_ptr()),
                                remainder.data_ptr<int16_t>(), source.numel()});
  return {param, remainder};
}

at::Tensor join_bf16_remainder(const at::Tensor& param, const at::Tensor& remainder) {
  TORCH_CHECK_TYPE(param.scalar_type() == at::kBFloat16 && remainder.scalar_type() == at::kShort,
                   "fusedamp: join_bf16_remainder: param must be bfloat16 and remainder int16, "
                   "got ", param.scalar_type(), " and ", remainder.scalar_type());
  TORCH_CHECK(param.sizes() == remainder.sizes(), "fusedamp: join_bf16_remainder: param has "
              "shape ", param.sizes(), " but remainder has ", remainder.sizes());
  const at::Tensor high = param.is_non_overlapping_and_dense() ? param : param.contiguous();
  const at::Tensor low = remainder.strides() == high.strides()
                             ? remainder
                             : at::empty_like(high, remainder.options()).copy_(remainder);
  at::Tensor master = at::empty_like(high, high.options().dtype(at::kFloat));
  run_kernel(JoinRemainderCall{high.device(), static_cast<const uint16_t*>(high.const_data_ptr()),
                               low.const_data_ptr<int16_t>(), master.data_ptr<float>(),
                               high.numel()});
  return master;
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedamp, CPU, m) {
  m.impl("split_bf16_remainder", &split_bf16_remainder);
  m.impl("join_bf16_remainder", &join_bf16_remainder);
}

}  // namespace fusedamp
