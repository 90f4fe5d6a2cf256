#include "stage_dp.h"

namespace rannc {

void bind_stage_dp(pybind11::module_& m) { (void)m; }

}  // namespace rannc
