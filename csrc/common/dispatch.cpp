// The one definition of dispatch.h's failure (see there why it is not inline).
#include <c10/util/Exception.h>

#include "fusedamp/dispatch.h"

namespace fusedamp {

void fail_no_kernel(const char* what, int32_t value, int32_t param_dtype) {
  if (param_dtype < 0) TORCH_CHECK(false, "fusedamp internal error: no kernel for ", what, " ", value);
  TORCH_CHECK(false, "fusedamp internal error: no kernel for ", what, " ", value,
              " with param element type ", param_dtype);
}

}  // namespace fusedamp
