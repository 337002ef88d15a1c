// Placeholder source so kvcached_core has something to compile before the core lands.
// Drop on merge: cpp/src/core/*.cpp from the core work replaces it.
namespace kvcached {
int core_placeholder() { return 0; }
}  // namespace kvcached
