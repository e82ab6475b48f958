#pragma once
#include <string>

namespace lintape {

struct Device {
  enum Kind { CPU, CUDA };
  Kind kind = CPU;
  int index = 0;

  static Device cpu() { return {CPU, 0}; }
  static Device cuda(int i = 0) { return {CUDA, i}; }
  bool is_cuda() const { return kind == CUDA; }
  bool operator==(const Device& o) const { return kind == o.kind && (kind == CPU || index == o.index); }
  bool operator!=(const Device& o) const { return !(*this == o); }
  std::string name() const { return kind == CPU ? "cpu" : "cuda:" + std::to_string(index); }
};

Device parse_device(const std::string& s);  // "cpu", "cuda", "cuda:1"
bool cuda_available();                       // built with CUDA and at least one device present
int cuda_device_count();                     // 0 without CUDA

}  // namespace lintape
