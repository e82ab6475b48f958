// Named tensors in the safetensors format (readable by PyTorch, numpy and the Hugging Face tools):
//   8 bytes: header length N, little-endian u64
//   N bytes: a JSON object {name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...,
//            "__metadata__": {string: string}}, padded with spaces
//   the data: each tensor's bytes, little-endian, row-major; offsets count from the end of the header.
// Checkpoints and weights go through these two calls. Loading checks everything against the file and
// throws an Error that says what is wrong; saving writes a temporary file and renames it into place.
#pragma once
#include <map>
#include <string>
#include "tensor.h"

namespace lintape {

// All tensors of the file, on the CPU, by name.
std::map<std::string, Tensor> load_safetensors(const std::string& path);
// The file's "__metadata__" (empty when it has none); checks the header only.
std::map<std::string, std::string> load_safetensors_metadata(const std::string& path);

// Tensors of any device, dtype and layout; stored contiguously, in name order.
void save_safetensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace lintape
