// SHA-256 (FIPS 180-4), for the checksums of checkpoint files. Internal: not installed.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace lintape {

std::string sha256_hex(const void* data, size_t size);
std::string sha256_hex(const std::string& bytes);
// Of a whole file; throws naming the file when it cannot be read.
std::string sha256_file(const std::string& path);

}  // namespace lintape
