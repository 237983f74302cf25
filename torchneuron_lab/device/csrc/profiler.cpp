// torch.profiler integration (filled in below).
#include "neuron.h"

namespace tnl {
void install_profiler_stubs() {}
}  // namespace tnl
