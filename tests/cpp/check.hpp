// A tiny check harness for the C++ tests: CHECK(condition), throws<E>(body),
// and a summary line; each test program exits non-zero on any failure (CTest).
#pragma once

#include <cstdio>
#include <functional>

namespace kvcached_test {

inline int passed = 0, failed = 0;

inline void check(bool condition, const char* what, const char* file, int line) {
  if (condition) {
    ++passed;
  } else {
    ++failed;
    std::fprintf(stderr, "FAILED %s:%d: %s\n", file, line, what);
  }
}

template <typename Exception>
bool throws(const std::function<void()>& body) {
  try {
    body();
  } catch (const Exception&) {
    return true;
  } catch (...) {
    return false;
  }
  return false;
}

inline int summary() {
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}

}  // namespace kvcached_test

#define CHECK(condition) ::kvcached_test::check((condition), #condition, __FILE__, __LINE__)
