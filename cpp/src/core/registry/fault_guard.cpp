// The SIGBUS handler behind fault_guard.hpp: a fixed table of watched mappings, then chaining.
#include "fault_guard.hpp"

#include <errno.h>
#include <signal.h>
#include <sys/mman.h>

#include <cstdint>
#include <mutex>

#include "kvcached/registry/registry_errors.hpp"

namespace kvcached::registry_detail {

namespace {

// Registries mapped at once by one process (each DeviceRegistry::open maps one).
constexpr std::size_t kMaxWatchedMappings = 1024;
constexpr int kWatchFree = 0;
constexpr int kWatchClaimed = 1;
constexpr int kWatchActive = 2;

// Read by the signal handler, so every field is a lock-free atomic.
struct Watch {
  std::atomic<int> state{kWatchFree};
  std::atomic<std::uintptr_t> begin{0};
  std::atomic<std::size_t> length{0};
  std::atomic<std::atomic<int>*> detached{nullptr};
  std::atomic<int> reason{0};
};

Watch g_watches[kMaxWatchedMappings];
struct sigaction g_previous_action;  // written once, before our handler is installed
std::once_flag g_install_once;

void chain_to_previous(int signal_number, siginfo_t* info, void* context) {
  const struct sigaction& previous = g_previous_action;
  if (previous.sa_flags & SA_SIGINFO) {
    previous.sa_sigaction(signal_number, info, context);
    return;
  }
  if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
    previous.sa_handler(signal_number);
    return;
  }
  // Default action (an ignored hardware fault would only repeat): restore it.
  // A fault then happens again on return and ends the process as it would have
  // without kvcached; a signal sent by kill() is sent again.
  struct sigaction default_action{};
  default_action.sa_handler = SIG_DFL;
  sigemptyset(&default_action.sa_mask);
  sigaction(signal_number, &default_action, nullptr);
  if (info == nullptr || info->si_code <= 0) raise(signal_number);
}

void on_sigbus(int signal_number, siginfo_t* info, void* context) {
  const int saved_errno = errno;
  // si_code > 0: raised by the kernel for a fault, with the faulting address.
  if (info != nullptr && info->si_code > 0) {
    const auto address = reinterpret_cast<std::uintptr_t>(info->si_addr);
    for (Watch& watch : g_watches) {
      if (watch.state.load(std::memory_order_acquire) != kWatchActive) continue;
      const std::uintptr_t begin = watch.begin.load(std::memory_order_relaxed);
      const std::size_t length = watch.length.load(std::memory_order_relaxed);
      if (address < begin || address - begin >= length) continue;
      if (replace_with_private_pages(reinterpret_cast<void*>(begin), length)) {
        int expected = 0;
        watch.detached.load()->compare_exchange_strong(expected, watch.reason.load());
        errno = saved_errno;
        return;  // the faulting access is retried on the private pages
      }
      break;
    }
  }
  errno = saved_errno;
  chain_to_previous(signal_number, info, context);
}

// Once per process, and never again: re-installing on top of a later handler
// that chains back to us could bounce a fault between the two forever.
void install_handler() {
  struct sigaction ours{};
  ours.sa_sigaction = on_sigbus;
  ours.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;
  sigemptyset(&ours.sa_mask);
  if (sigaction(SIGBUS, nullptr, &g_previous_action) != 0 || sigaction(SIGBUS, &ours, nullptr) != 0) {
    throw RegistryError(
        "registry: cannot install the SIGBUS handler that protects engines from a "
        "truncated registry file");
  }
}

}  // namespace

bool replace_with_private_pages(void* address, std::size_t length) noexcept {
  void* replaced = mmap(address, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
  return replaced != MAP_FAILED;
}

int watch_mapping(void* address, std::size_t length, std::atomic<int>* detached, int reason) {
  std::call_once(g_install_once, install_handler);
  for (std::size_t index = 0; index < kMaxWatchedMappings; ++index) {
    Watch& watch = g_watches[index];
    int expected = kWatchFree;
    if (!watch.state.compare_exchange_strong(expected, kWatchClaimed)) continue;
    watch.begin.store(reinterpret_cast<std::uintptr_t>(address), std::memory_order_relaxed);
    watch.length.store(length, std::memory_order_relaxed);
    watch.detached.store(detached, std::memory_order_relaxed);
    watch.reason.store(reason, std::memory_order_relaxed);
    watch.state.store(kWatchActive, std::memory_order_release);
    return static_cast<int>(index);
  }
  throw RegistryError("registry: more than " + std::to_string(kMaxWatchedMappings) +
                      " registries are open in this process");
}

void unwatch_mapping(int token) noexcept {
  if (token >= 0) g_watches[token].state.store(kWatchFree, std::memory_order_release);
}

}  // namespace kvcached::registry_detail
