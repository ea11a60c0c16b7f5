// Per-thread scratch of the matmul kernels (quant_matmul.cpp, quant_linear.cpp), kept from call to call: a fresh
// vector was zero-filled on every call, and one over glibc's mmap threshold faulted its pages in again. Scratch
// over kKeptBytes (an LM head's 57 MB of dequantized weights, a long prefill's 25 MB of int16 activations) is not
// kept: it lives as long as the call, and is not zero-filled (the caller writes it before reading it).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

namespace pagedllm {

constexpr int64_t kKeptBytes = 8 << 20;

// tag: which scratch of the calling thread. Every use names its own tag, across files: two scratches of one
// (T, tag) alive at once on a thread would share their memory.
template <typename T, int tag>
class KeptScratch {
 public:
  explicit KeptScratch(int64_t elements) {
    thread_local std::vector<T> kept;
    if (elements * static_cast<int64_t>(sizeof(T)) > kKeptBytes) {
      own_.reset(new T[elements]);
      data_ = own_.get();
      return;
    }
    if (static_cast<int64_t>(kept.size()) < elements) kept.resize(elements);
    data_ = kept.data();
  }
  T* data() const { return data_; }

 private:
  std::unique_ptr<T[]> own_;
  T* data_;
};

}  // namespace pagedllm
