// encode_state and decode_state: dense tensors in any memory format (blocks run over storage
// order, as the optimizer kernels walk it), outputs in the input's format. CPU only: the
// optimizers use them when a state is loaded from or exported to a torch.optim state_dict.
#include "ops/codec.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include "common/registry.h"
#include "fusedamp/math/codec.h"

namespace fusedamp {
namespace {

std::tuple<at::Tensor, at::Tensor> encode_state(const at::Tensor& values, bool is_signed) {
  TORCH_CHECK_TYPE(values.scalar_type() == at::kFloat, "fusedamp: encode_state: values must be "
                   "float32, got ", values.scalar_type());
  const at::Tensor source = values.is_non_overlapping_and_dense() ? values : values.contiguous();
  at::Tensor codes = at::empty_like(source, source.options().dtype(at::kByte));
  at::Tensor scales = at::empty({codec_blocks(source.numel())}, source.options().dtype(at::kBFloat16));
  run_kernel(EncodeStateCall{source.device(), source.const_data_ptr<float>(), codes.data_ptr<uint8_t>(),
                             static_cast<uint16_t*>(scales.data_ptr()), source.numel(), is_signed});
  return {codes, scales};
}

at::Tensor decode_state(const at::Tensor& codes, const at::Tensor& scales, bool is_signed) {
  TORCH_CHECK_TYPE(codes.scalar_type() == at::kByte && scales.scalar_type() == at::kBFloat16,
                   "fusedamp: decode_state: codes must be uint8 and scales bfloat16, got ",
                   codes.scalar_type(), " and ", scales.scalar_type());
  TORCH_CHECK(codes.is_non_overlapping_and_dense(), "fusedamp: decode_state: codes must be dense "
              "(sizes ", codes.sizes(), ", strides ", codes.strides(), ")");
  TORCH_CHECK(scales.is_contiguous() && scales.numel() == codec_blocks(codes.numel()),
              "fusedamp: decode_state: scales must be a contiguous tensor of one scale per ",
              kCodecBlock, " codes (", codec_blocks(codes.numel()), "), got ", scales.numel());
  at::Tensor values = at::empty_like(codes, codes.options().dtype(at::kFloat));
  run_kernel(DecodeStateCall{codes.device(), codes.const_data_ptr<uint8_t>(),
                             static_cast<const uint16_t*>(scales.const_data_ptr()), values.data_ptr<float>(),
                             codes.numel(), is_signed});
  return values;
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedamp, CPU, m) {
  m.impl("encode_state", &encode_state);
  m.impl("decode_state", &decode_state);
}

}  // namespace fusedamp
