// MirrorBudgets: per-mirror budget charges, taken all or nothing.
#include "kvcached/blocks/mirror_budgets.hpp"

#include <algorithm>
#include <limits>
#include <string>

namespace kvcached {

MirrorBudgets::MirrorBudgets(std::vector<MirrorSpec> mirrors, std::size_t default_page_bytes) {
  if (mirrors.empty()) throw InvalidArgument("a block manager needs at least one mirror");
  for (MirrorSpec& spec : mirrors) {
    const std::size_t bytes = spec.layout ? spec.layout->page_id_bytes() : default_page_bytes;
    if (bytes == 0) throw InvalidArgument("a mirror's page_bytes must be positive");
    if (spec.budget && spec.budget->may_block()) may_block_ = true;
    mirrors_.push_back({std::move(spec.budget), bytes});
  }
}

std::size_t MirrorBudgets::max_charged_pages() const noexcept {
  std::size_t most = 0;
  for (const Mirror& m : mirrors_) {
    if (m.alive) most = std::max(most, m.charged);
  }
  return most;
}

void MirrorBudgets::add_charge(const std::vector<std::size_t>& pages) noexcept {
  for (std::size_t i = 0; i < mirrors_.size(); ++i) mirrors_[i].charged += pages[i];
}

void MirrorBudgets::remove_charge(const std::vector<std::size_t>& pages) noexcept {
  for (std::size_t i = 0; i < mirrors_.size(); ++i) mirrors_[i].charged -= pages[i];
}

void MirrorBudgets::end_release(std::size_t i, std::size_t pages) noexcept {
  mirrors_[i].releasing -= pages;
  mirrors_[i].charged -= pages;
}

std::size_t MirrorBudgets::mark_lost(std::size_t i) noexcept {
  Mirror& m = mirrors_[i];
  m.alive = false;
  return m.charged - m.releasing;  // what is being given back already stays with end_release
}

std::optional<std::size_t> MirrorBudgets::take(const std::vector<std::size_t>& pages, bool for_reserve) const {
  std::size_t taken = 0;
  try {
    for (; taken < mirrors_.size(); ++taken) {
      const Mirror& m = mirrors_[taken];
      if (pages[taken] == 0 || !m.budget) continue;
      const std::size_t bytes = pages[taken] * m.page_bytes;
      if (!(for_reserve ? m.budget->try_acquire_for_reserve(bytes) : m.budget->try_acquire(bytes))) break;
    }
  } catch (...) {
    for (std::size_t i = 0; i < taken; ++i) give(i, pages[i]);
    throw;
  }
  if (taken == mirrors_.size()) return std::nullopt;
  for (std::size_t i = 0; i < taken; ++i) give(i, pages[i]);
  return taken;
}

void MirrorBudgets::give(std::size_t i, std::size_t pages) const noexcept {
  const Mirror& m = mirrors_[i];
  if (pages > 0 && m.budget) m.budget->release(pages * m.page_bytes);
}

std::size_t MirrorBudgets::room_pages(std::size_t i) const {
  const Mirror& m = mirrors_[i];
  if (!m.budget) return std::numeric_limits<std::size_t>::max();
  return m.budget->available_bytes() / m.page_bytes;
}

std::size_t MirrorBudgets::reachable_pages(std::size_t i) const {
  const Mirror& m = mirrors_[i];
  const std::optional<std::size_t> bytes = m.budget ? m.budget->reachable_bytes() : std::nullopt;
  return bytes ? *bytes / m.page_bytes : std::numeric_limits<std::size_t>::max();
}

std::optional<MirrorBudgets::ExternalLimit> MirrorBudgets::external_limit() const {
  std::optional<ExternalLimit> tightest;
  for (const Mirror& m : mirrors_) {
    if (!m.alive || !m.budget) continue;
    if (auto limit = m.budget->external_limit_bytes()) {
      const std::size_t pages = *limit / m.page_bytes;
      if (!tightest || pages < tightest->pages) tightest = ExternalLimit{pages, *limit};
    }
  }
  return tightest;
}

void MirrorBudgets::check_usable() const {
  for (const Mirror& m : mirrors_) {
    if (m.alive && m.budget) m.budget->check_usable();
  }
}

bool MirrorBudgets::others_waiting() const noexcept {
  for (const Mirror& m : mirrors_) {
    if (m.alive && m.budget && m.budget->pressure_bytes() > 0) return true;
  }
  return false;
}

void MirrorBudgets::report_usage(std::size_t used_pages) const noexcept {
  for (const Mirror& m : mirrors_) {
    if (m.alive && m.budget) m.budget->report_usage(used_pages * m.page_bytes, m.charged * m.page_bytes);
  }
}

void MirrorBudgets::report_worker_errors(std::uint64_t worker_errors) const noexcept {
  for (const Mirror& m : mirrors_) {
    if (m.alive && m.budget) m.budget->report_worker_errors(worker_errors);
  }
}

}  // namespace kvcached
