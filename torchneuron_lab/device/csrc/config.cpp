// Device count and HBM capacity: fixed when the first device is used.
#include "neuron.h"

#include <c10/util/Exception.h>

#include <mutex>

namespace tnl {

namespace {
std::atomic<bool> g_started{false};
}

Config& config() {
  static Config c;
  return c;
}

void configure(int num_devices, int64_t hbm_bytes) {
  TORCH_CHECK_VALUE(num_devices >= 1 && num_devices <= 64,
                    "num_devices must be in [1, 64], got ", num_devices);
  TORCH_CHECK_VALUE(hbm_bytes >= (1 << 20), "hbm_bytes must be at least 1 MiB, got ", hbm_bytes);
  if (g_started.load()) {
    const Config& c = config();
    TORCH_CHECK(c.num_devices == num_devices && c.hbm_bytes == hbm_bytes,
                "the emulated neuron devices are already in use (", c.num_devices, " devices of ", c.hbm_bytes,
                " bytes); configure() must be called before the first neuron tensor is created");
    return;
  }
  config().num_devices = num_devices;
  config().hbm_bytes = hbm_bytes;
}

bool runtime_started() { return g_started.load(); }
void mark_runtime_started() { g_started.store(true); }
int device_count() { return config().num_devices; }

void check_device_index(int64_t index) {
  // RuntimeError, as CUDA raises for an invalid device ordinal
  TORCH_CHECK(index >= 0 && index < device_count(), "invalid neuron device index ", index,
                    ": there are ", device_count(), " emulated neuron devices (neuron:0 .. neuron:",
                    device_count() - 1, ")");
}

}  // namespace tnl
