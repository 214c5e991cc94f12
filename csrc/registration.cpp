// The single declaration of every fusedamp operator schema. Each op's function is in
// csrc/ops/<op>.cpp, its kernels in csrc/cpu/kernels/ and csrc/cuda/ (see csrc/README.md).
#include <torch/library.h>

TORCH_LIBRARY(fusedamp, m) {
  // grads *= inv_scale in place; found_inf = 1 if any grad element (before scaling) is
  // non-finite, else left as it was. Grads may mix fp32, fp16 and bf16.
  m.def("unscale_(Tensor(a!)[] grads, Tensor(b!) found_inf, Tensor inv_scale) -> ()");
  // Read-only pass over the grads: found_inf as above; when sum_of_squares is given, adds
  // sum((g * inv_scale)^2) over all elements to it (inv_scale = 1 when absent).
  m.def(
      "check_and_norm_(Tensor[] grads, Tensor(a!) found_inf, Tensor(b!)? sum_of_squares, "
      "Tensor? inv_scale) -> ()");
  // Dynamic loss scale on the device (math/scale.h): backoff on a found_inf that is not 0 after
  // `hysteresis` overflows, growth after growth_interval clean steps, within [min, max].
  m.def(
      "update_scale_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor(c!) hysteresis_tracker, "
      "Tensor found_inf, float growth_factor, float backoff_factor, int growth_interval, "
      "int hysteresis, float min_scale, float max_scale) -> ()");
  // One fused AdamW step per list position (math/adamw.h). Empty max_exp_avg_sqs unless
  // amsgrad; empty masters, or one fp32 (full) / int16 (remainder, bf16 params) per param.
  // steps: one fp32 scalar per param, the count before this step; incremented unless skipped.
  // grads are multiplied by inv_grad_scale * clip_coef; a found_inf that is not 0 (NaN included) skips everything.
  m.def(
      "adamw_(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] exp_avgs, "
      "Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] max_exp_avg_sqs, Tensor(f!)[] masters, "
      "Tensor(g!)[] steps, float lr, Tensor? lr_tensor, float beta1, float beta2, float eps, "
      "float weight_decay, bool amsgrad, bool maximize, Tensor? inv_grad_scale, "
      "Tensor? found_inf, Tensor? clip_coef, bool write_unscaled_grads, "
      "Tensor(h!)[]? exp_avg_scales=None, Tensor(i!)[]? exp_avg_sq_scales=None, "
      "Tensor(j!)[]? max_exp_avg_sq_scales=None, int[]? rounding_ids=None, "
      "int rounding_seed=0, bool stochastic_params=False) -> ()");
  // [note: state codecs] Moments (and SGD's momentum buffers) are float32, bfloat16 or uint8
  // block codes (math/codec.h), one dtype for every state list of a call; uint8 states come with
  // their bf16 scale lists (one per 256 elements of storage order, the block's code form in the
  // sign bit); bf16 and uint8 states are rounded stochastically ([note: unbiased state
  // rounding]). Random bits come from a hash of (rounding_seed, rounding_ids[i] (default: i),
  // element, stream) and the step count: hashed in for the params, a rotation of the states'
  // draws ([note: dithered draws]).
  // stochastic_params (fp16/bf16 params without masters): the params take the update
  // stochastically rounded too.
  // One fused SGD step (math/sgd.h); momentum_buffers empty when momentum == 0; a param whose
  // step count is 0 takes its first step (buffer = grad).
  m.def(
      "sgd_(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] momentum_buffers, "
      "Tensor(d!)[] masters, Tensor(e!)[] steps, float lr, Tensor? lr_tensor, float momentum, "
      "float dampening, float weight_decay, bool nesterov, bool maximize, "
      "Tensor? inv_grad_scale, Tensor? found_inf, Tensor? clip_coef, "
      "bool write_unscaled_grads, Tensor(f!)[]? momentum_buffer_scales=None, "
      "int[]? rounding_ids=None, int rounding_seed=0, bool stochastic_params=False) -> ()");
  // The elementwise first half of a Muon step (math/muon.h): each momentum buffer lerped toward
  // its grad (multiplied by inv_grad_scale * clip_coef), and the update to orthogonalize (the
  // Nesterov blend, or the buffer) written into `updates` (float32 or bfloat16, shaped like the
  // grads). steps are read (the rotation of the dithered draws of bf16 / uint8 buffers, [note:
  // dithered draws]), not incremented: the Muon step's sgd_ on the orthogonalized updates does
  // that. found_inf set: nothing is written.
  m.def(
      "muon_momentum_(Tensor(a!)[] updates, Tensor(b!)[] grads, Tensor(c!)[] momentum_buffers, "
      "Tensor[] steps, float momentum, bool nesterov, Tensor? inv_grad_scale, Tensor? found_inf, "
      "Tensor? clip_coef, bool write_unscaled_grads, Tensor(d!)[]? momentum_buffer_scales=None, "
      "int[]? rounding_ids=None, int rounding_seed=0) -> ()");
  // The bf16 remainder encoding of fp32 masters (math/master.h, [note: remainder encoding]):
  // split turns fp32 masters into (bf16 param, int16 remainder), join rebuilds the masters.
  // Dense tensors in any memory format; the outputs take the input's. CPU only: the optimizers
  // use them once, when a param's master state is made or converted.
  m.def("split_bf16_remainder(Tensor master) -> (Tensor param, Tensor remainder)");
  m.def("join_bf16_remainder(Tensor param, Tensor remainder) -> Tensor");
  // The 8-bit block codes of a float32 state (math/codec.h [note: block codes]): signed (exp_avg,
  // momentum) or unsigned (exp_avg_sq); blocks of 256 elements in storage order, codes in the
  // input's memory format, scales 1-D bfloat16. CPU only: used when states are imported or
  // exported.
  m.def("encode_state(Tensor values, bool is_signed) -> (Tensor codes, Tensor scales)");
  m.def("decode_state(Tensor codes, Tensor scales, bool is_signed) -> Tensor");
  // out = act(a @ b + bias) with fp32 accumulation, rounded once to out_dtype (a's dtype or
  // float32). a (..., K) fp16/bf16, leading dims flattened; b (K, N) same dtype, any strides (pass
  // W.t() for x @ W.T); bias (N,) in a's dtype or float32; activation none|relu|gelu|gelu_tanh.
  // Returns (out (..., N), preactivation): the latter is a @ b + bias in out_dtype when
  // keep_preactivation (what the activation's backward needs), else an empty tensor.
  m.def(
      "gemm(Tensor a, Tensor b, Tensor? bias=None, str activation=\"none\", "
      "ScalarType? out_dtype=None, bool keep_preactivation=False) -> (Tensor, Tensor)");
  // Gradient diagnostics (math/grad_stats.h), read-only: per grad, counts[i] = (number of
  // values with 0 < |g * inv_scale| < 2^-24, same below 2^-14, non-finite count) as int64, and
  // max_abs[i] = the largest |g * inv_scale| over the finite g as float32 (inf when that product
  // overflows float32: the unscaled gradient does not fit). Grads may mix float dtypes.
  m.def("grad_stats(Tensor[] grads, Tensor? inv_scale) -> (Tensor counts, Tensor max_abs)");
}
