// Placeholder kvcached._core so this branch builds before the real core bindings land.
// Drop on merge: cpp/bindings/core/*.cpp from the core work replaces it.
#include <nanobind/nanobind.h>

NB_MODULE(_core, m) { m.doc() = "placeholder core module (replaced by the real bindings)"; }
