#include "coarsen.h"

namespace rannc {

void bind_coarsen(pybind11::module_& m) { (void)m; }

}  // namespace rannc
