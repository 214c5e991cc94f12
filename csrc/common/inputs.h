// The argument rules the ops share, each written once: a check evaluates its rule a single time
// and builds its message only when the rule fails ([note: lazy names]).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <ostream>
#include <vector>

#include "fusedamp/math/codec.h"
#include "fusedamp/math/dtypes.h"
#include "fusedamp/math/master.h"
#include "fusedamp/step_inputs.h"

namespace fusedamp {

// [note: lazy names] An argument's name as the messages print it ("adamw_: grads[3]"): three
// words, no string, so a call over thousands of tensors pays nothing for the messages of checks
// that pass (TORCH_CHECK formats its message only on failure).
struct ArgName {
  const char* op;  // null: the name alone
  const char* arg;
  int64_t index = -1;  // the position in a list argument; -1 for a single tensor
};
std::ostream& operator<<(std::ostream& out, const ArgName& name);

// fp32 / fp16 / bf16 -> DType; anything else is a TypeError naming the argument.
DType float_dtype_of(const at::Tensor& tensor, const ArgName& name);

// A one-element fp32 tensor on `device` (scale, found_inf, lr, clip_coef, a step count).
void check_scalar_tensor(const at::Tensor& tensor, const ArgName& name, const at::Device& device);

// A strided tensor on `device` without gaps or overlaps, in any memory format ([note: dense layouts]).
void check_dense_on(const at::Tensor& tensor, const ArgName& name, const at::Device& device);

void check_hyperparameter(double value, const char* name, const char* op);

// Tensors an op writes (or writes one and reads another of) must not share memory; tensors it
// only reads (read_only) may share memory with each other, as two params' shared grad does. A
// list argument's tensors are named "name[i]"; a single tensor's (is_list false) just "name".
struct NamedTensors {
  at::TensorList tensors;
  const char* name;
  bool is_list = true;
  bool read_only = false;
};
void check_no_shared_memory(const char* op, const std::vector<NamedTensors>& arguments);

// A list of grads of any float dtypes, each dense on `device`: returns their dtypes.
std::vector<DType> check_grad_list(at::TensorList grads, const char* op, const at::Device& device);

// The tensors of one optimizer call, after check_optimizer_lists.
struct OptimizerLists {
  DType param_dtype;
  DType grad_dtype;
  MasterKind master_kind;
  at::Device device;
};

// An fp32 per-param state list (exp_avgs, momentum_buffers, ...): one tensor per param when
// `required`, else either that or empty.
struct StateList {
  at::TensorList tensors;
  const char* name;
  bool required;
  at::ScalarType dtype = at::kFloat;  // the element type of the call's state codec
};

// The list rules of every optimizer op: one param dtype, grads of one dtype, fp32 states, masters
// (none, fp32, or int16 remainders of bf16 params), fp32 step counts, all dense on the params'
// device, each companion with its param's element count and element order, no shared memory.
OptimizerLists check_optimizer_lists(const char* op, at::TensorList params, at::TensorList grads,
                                     const std::vector<StateList>& states, at::TensorList masters,
                                     at::TensorList steps, bool grads_written);

// Whether an optimizer step writes its grads back (unscaled or clipped): StepInputs::write_grad.
bool step_writes_grads(bool write_unscaled_grads, const c10::optional<at::Tensor>& inv_grad_scale,
                       const c10::optional<at::Tensor>& clip_coef);

// [note: state codecs] The codec of an optimizer call's states, from the first state tensor's
// dtype (float32, bfloat16, uint8 block codes); float32 when there is none.
StateCodec state_codec_of(const char* op, at::TensorList states, const char* name);
at::ScalarType codec_dtype(StateCodec codec);

// The scale lists of uint8 states (states[k] goes with scales[k]): one contiguous bfloat16 tensor
// of codec_blocks(numel) per param wherever its state list is used, none for other codecs; and no
// tensor of the call (params, grads, masters, steps, states, scales) shares memory with another.
void check_state_scales(const char* op, StateCodec codec, at::TensorList params,
                        const std::vector<StateList>& states, const std::vector<StateList>& scales,
                        const std::vector<NamedTensors>& others);

// The ids of a call's params for its random bits (math/stochastic.h): rounding_ids, one per param,
// or (empty) each param's position in the list. stochastic_params: the params take their update
// rounded stochastically, which only fp16 / bf16 params without masters can.
std::vector<int64_t> check_rounding_ids(const char* op, const OptimizerLists& lists, size_t count,
                                        const c10::optional<at::IntArrayRef>& rounding_ids,
                                        bool stochastic_params);

// Checks the step scalars of an optimizer op on `device` (a CPU lr_tensor is read on the host and
// may drive a step on any device) and returns them as the kernels read them.
StepInputs check_step_inputs(const char* op, const at::Device& device, double lr,
                             const c10::optional<at::Tensor>& lr_tensor,
                             const c10::optional<at::Tensor>& inv_grad_scale,
                             const c10::optional<at::Tensor>& found_inf,
                             const c10::optional<at::Tensor>& clip_coef, bool write_unscaled_grads);

}  // namespace fusedamp
