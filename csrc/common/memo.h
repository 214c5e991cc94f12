// A bounded, thread-safe memo of a pure host function, keyed on every argument it depends on: the
// GEMM launchers keep their TMA descriptors and per-device kernel attributes in one, so that a
// call repeats no driver work an earlier call with the same arguments did.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <array>
#include <mutex>
#include <unordered_map>

namespace fusedamp {

template <size_t kWords>
using MemoKey = std::array<uint64_t, kWords>;

template <size_t kWords>
struct MemoKeyHash {
  size_t operator()(const MemoKey<kWords>& key) const {
    uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a over the words
    for (const uint64_t word : key) h = (h ^ word) * 0x100000001b3ull;
    return size_t(h ^ (h >> 32));
  }
};

template <size_t kWords, typename Value>
class Memo {
 public:
  // At most `capacity` values are kept: when full, the memo forgets them all and makes them again
  // on demand (a training step's working set is far smaller than the capacity; any key is remade
  // correctly, so forgetting only costs time).
  explicit Memo(size_t capacity) : capacity_(capacity) {}

  // The value for `key`: make() on the first call with it, else the kept value. make() runs
  // outside the lock (it may be slow); a make() that throws keeps nothing. Two threads missing the
  // same key at once both make it, which is harmless: make() is a pure function of the key.
  template <typename Make>
  Value get(const MemoKey<kWords>& key, Make&& make) {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      const auto found = values_.find(key);
      if (found != values_.end()) return found->second;
    }
    Value value = make();
    const std::lock_guard<std::mutex> lock(mutex_);
    if (values_.size() >= capacity_) values_.clear();
    values_.emplace(key, value);
    return value;
  }

  size_t size() {
    const std::lock_guard<std::mutex> lock(mutex_);
    return values_.size();
  }

 private:
  const size_t capacity_;
  std::mutex mutex_;
  std::unordered_map<MemoKey<kWords>, Value, MemoKeyHash<kWords>> values_;
};

}  // namespace fusedamp
