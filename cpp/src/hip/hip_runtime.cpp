// HIP runtime plumbing: the call lock, errors, device checks and identity (hip_runtime.hpp).
#include "hip/hip_runtime.hpp"

#include <cstring>

#include "kvcached/device/device_identity.hpp"

namespace kvcached::hip {

std::mutex& runtime_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::string driver_message(hipError_t code) {
  const char* name = hipGetErrorName(code);
  const char* description = hipGetErrorString(code);
  return std::string(name != nullptr ? name : "unknown hipError_t") + ": " +
         (description != nullptr ? description : "no description from the runtime");
}

void throw_driver_error(const char* call, hipError_t code) {
  if (code == hipErrorOutOfMemory) {
    throw DeviceOutOfMemory(kBackendName, call, code, driver_message(code));
  }
  throw DriverError(kBackendName, call, code, driver_message(code));
}

namespace {
// The device kvcached made current on this thread for good (-1: none).
thread_local int t_bound_device = -1;
}  // namespace

void bind_calling_thread(int ordinal) {
  std::lock_guard<std::mutex> lock(runtime_mutex());
  check("hipSetDevice", hipSetDevice(ordinal));
  t_bound_device = ordinal;
}

ScopedHipCall::ScopedHipCall(int ordinal) : lock_(runtime_mutex()) {
  if (t_bound_device == ordinal) return;  // kvcached's own thread: nobody else switches it
  check("hipGetDevice", hipGetDevice(&previous_));
  if (previous_ != ordinal) {
    check("hipSetDevice", hipSetDevice(ordinal));
    switched_ = true;
  }
}

ScopedHipCall::~ScopedHipCall() {
  // Best effort: a failure here cannot be reported from a destructor.
  if (switched_) (void)hipSetDevice(previous_);
}

hipMemAllocationProp device_allocation_prop(int ordinal) {
  hipMemAllocationProp prop{};
  prop.type = hipMemAllocationTypePinned;
  prop.location.type = hipMemLocationTypeDevice;
  prop.location.id = ordinal;
  return prop;
}

void require_device(int ordinal) {
  std::lock_guard<std::mutex> lock(runtime_mutex());
  int count = 0;
  const hipError_t result = hipGetDeviceCount(&count);
  if (result != hipSuccess) {
    throw BackendUnavailable("no HIP device: hipGetDeviceCount returned " + driver_message(result));
  }
  if (ordinal < 0 || ordinal >= count) {
    throw BackendUnavailable("no HIP device " + std::to_string(ordinal) + ": the runtime reports " +
                             std::to_string(count) + " device(s) (after ROCR_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES)");
  }
}

namespace {

// What to check, for the error message of a device without VMM support.
constexpr const char* kVmmAdvice =
    "kvcached needs hipMemCreate / hipMemMap. Check that this GPU supports them (MI100 has "
    "been reported without), that the amdgpu kernel driver is recent enough (on Ubuntu the "
    "HWE kernel or ROCm's amdgpu-dkms), and what `rocminfo` and `kvcached info` report";

bool granularity_query_answers(int ordinal) {
  const hipMemAllocationProp prop = device_allocation_prop(ordinal);
  std::size_t granularity_bytes = 0;
  return hipMemGetAllocationGranularity(&granularity_bytes, &prop, hipMemAllocationGranularityRecommended) ==
             hipSuccess &&
         granularity_bytes != 0;
}

// ROCm reports the UUID as the 16 hex characters rocminfo prints after "GPU-",
// and "XX" (or nothing) for a device that has none.
bool is_uuid_text(const unsigned char* bytes) {
  for (std::size_t i = 0; i < identity::kUuidBytes; ++i) {
    const char c = static_cast<char>(bytes[i]);
    const bool hex = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
    if (!hex) return false;
  }
  return true;
}

bool is_missing_uuid(const unsigned char* bytes) {
  if (bytes[0] == 'X' && bytes[1] == 'X') return true;
  for (std::size_t i = 0; i < identity::kUuidBytes; ++i) {
    if (bytes[i] != 0) return false;
  }
  return true;
}

}  // namespace

bool vmm_supported(int ordinal, std::string* why_not) {
  std::lock_guard<std::mutex> lock(runtime_mutex());
  int supported = 0;
  const hipError_t result = hipDeviceGetAttribute(&supported, kVmmSupportedAttribute, ordinal);
  std::string reason;
  if (result == hipSuccess) {
    if (supported != 0) return true;
    reason = std::string(kVmmSupportedAttributeName) + " is 0";
  } else if (result == hipErrorInvalidValue && granularity_query_answers(ordinal)) {
    return true;  // a runtime older than the attribute, with a working VMM API
  } else {
    reason =
        std::string("hipDeviceGetAttribute(") + kVmmSupportedAttributeName + ") returned " + driver_message(result);
  }
  if (why_not != nullptr) *why_not = reason + ". " + kVmmAdvice;
  return false;
}

std::string physical_device_name(int ordinal) {
  std::lock_guard<std::mutex> lock(runtime_mutex());
  hipDevice_t device = 0;
  check("hipDeviceGet", hipDeviceGet(&device, ordinal));
#if HIP_VERSION >= 50200000  // hipDeviceGetUuid arrived in ROCm 5.2
  hipUUID uuid{};
  if (hipDeviceGetUuid(&uuid, device) == hipSuccess) {
    const auto* bytes = reinterpret_cast<const unsigned char*>(uuid.bytes);
    if (is_uuid_text(bytes)) {
      return identity::from_uuid_text(kBackendName, std::string(uuid.bytes, identity::kUuidBytes));
    }
    if (!is_missing_uuid(bytes)) return identity::from_uuid_bytes(kBackendName, bytes);
  }
#endif
  char bus_id[64] = {};
  check("hipDeviceGetPCIBusId", hipDeviceGetPCIBusId(bus_id, sizeof bus_id, device));
  return identity::from_pci_bus_id(kBackendName, bus_id);
}

}  // namespace kvcached::hip
