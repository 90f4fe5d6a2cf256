// Phase 3 (paper III-C, Algorithm 1): stages of consecutive blocks and the
// number of replicas of each, by dynamic programming. See rannc/stage_dp/.
#pragma once

#include <pybind11/pybind11.h>

namespace rannc {

// Registers the stage DP functions on the rannc._C module.
void bind_stage_dp(pybind11::module_& m);

}  // namespace rannc
