#include "core/safetensors.h"
#include <unistd.h>
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

namespace lintape {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors data is little-endian; this code copies it as is and needs a little-endian host");

using json = nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = uint64_t(100) << 20;  // the format's own limit

const char* format_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
    case DType::F64: return "F64";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
  }
  return "?";
}

struct Entry {
  std::string name;
  DType dtype = DType::F32;
  Shape shape;
  uint64_t begin = 0, end = 0;
};

struct Header {
  std::vector<Entry> entries;  // in the order of their data
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;  // file position of the data, 8 + header length
};

// Reads and checks everything but the tensor bytes: after this, every tensor's bytes lie inside the
// file, and the tensors tile the data exactly.
class Reader {
 public:
  explicit Reader(const std::string& path) : path_(path) {
    std::error_code ec;
    if (!std::filesystem::exists(path, ec)) bad("no such file");
    if (!std::filesystem::is_regular_file(path, ec)) bad("not a regular file");
    file_size_ = std::filesystem::file_size(path, ec);
    if (ec) bad(str("cannot read its size: ", ec.message()));
    in_.open(path, std::ios::binary);
    if (!in_) bad(str("cannot open it: ", std::strerror(errno)));
  }

  Header header() {
    if (file_size_ < 8)
      bad(str("the file has ", file_size_, " bytes; a safetensors file starts with an 8-byte header length"));
    uint64_t n = 0;
    read_at(0, &n, 8);
    if (n > kMaxHeaderBytes) bad(str("header length ", n, " is over the format's limit of ", kMaxHeaderBytes));
    if (n > file_size_ - 8) bad(str("header length ", n, " reaches beyond the end of the file (", file_size_, " bytes)"));
    std::string text(size_t(n), '\0');
    read_at(8, text.data(), n);
    json j;
    try {
      j = json::parse(text);
    } catch (const json::exception& e) {
      bad(str("the header is not valid JSON: ", e.what()));
    }
    if (!j.is_object()) bad(str("the header must be a JSON object; got ", j.type_name()));

    Header h;
    h.data_start = 8 + n;
    uint64_t data_size = file_size_ - h.data_start;
    for (auto& [key, value] : j.items()) {
      if (key == "__metadata__")
        h.metadata = metadata(value);
      else
        h.entries.push_back(entry(key, value, data_size));
    }
    std::sort(h.entries.begin(), h.entries.end(),
              [](const Entry& a, const Entry& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
    uint64_t pos = 0;
    const Entry* prev = nullptr;
    for (const Entry& e : h.entries) {
      if (e.begin < pos)
        bad(str("tensors '", prev->name, "' [", prev->begin, ", ", prev->end, ") and '", e.name, "' [", e.begin, ", ",
                e.end, ") overlap"));
      if (e.begin > pos) bad(str("data bytes [", pos, ", ", e.begin, ") belong to no tensor"));
      pos = e.end;
      prev = &e;
    }
    if (pos != data_size)
      bad(str("the file has ", data_size - pos, " bytes after the last tensor's data that belong to no tensor"));
    return h;
  }

  Tensor tensor(const Header& h, const Entry& e) {
    Tensor t = empty(e.shape, e.dtype, Device::cpu());
    read_at(h.data_start + e.begin, t.data(), e.end - e.begin);
    return t;
  }

 private:
  [[noreturn]] void bad(const std::string& what) const { fail(str("[load_safetensors] ", path_, ": ", what)); }

  void read_at(uint64_t pos, void* dst, uint64_t bytes) {
    if (bytes == 0) return;
    in_.seekg(std::streamoff(pos));
    in_.read(static_cast<char*>(dst), std::streamsize(bytes));
    if (!in_ || uint64_t(in_.gcount()) != bytes)
      bad(str("could not read ", bytes, " bytes at offset ", pos, " (was the file changed while loading?)"));
  }

  std::map<std::string, std::string> metadata(const json& value) const {
    if (!value.is_object()) bad(str("__metadata__ must be an object of strings; got ", value.type_name()));
    std::map<std::string, std::string> out;
    for (auto& [k, v] : value.items()) {
      if (!v.is_string()) bad(str("__metadata__ entry '", k, "' must be a string; got ", v.type_name()));
      out[k] = v.get<std::string>();
    }
    return out;
  }

  Entry entry(const std::string& name, const json& value, uint64_t data_size) const {
    std::string where = str("tensor '", name, "': ");
    if (!value.is_object()) bad(str(where, "expected an object with dtype, shape and data_offsets; got ", value.type_name()));
    for (const char* key : {"dtype", "shape", "data_offsets"})
      if (!value.contains(key)) bad(str(where, "missing \"", key, "\""));
    Entry e;
    e.name = name;

    const json& dt = value["dtype"];
    bool known = false;
    for (DType t : {DType::F32, DType::BF16, DType::F16, DType::F64, DType::I32, DType::I64})
      if (dt.is_string() && dt.get<std::string>() == format_name(t)) {
        e.dtype = t;
        known = true;
      }
    if (!known) bad(str(where, "unknown dtype ", dt.dump(), "; expected one of F32, BF16, F16, F64, I32, I64"));

    const json& sh = value["shape"];
    if (!sh.is_array() || sh.size() > size_t(kMaxDims))
      bad(str(where, "shape must be an array of at most ", kMaxDims, " sizes; got ", sh.dump()));
    uint64_t bytes = dtype_size(e.dtype);
    for (const json& s : sh) {
      if (!s.is_number_unsigned()) bad(str(where, "shape must hold non-negative integers; got ", sh.dump()));
      uint64_t v = s.get<uint64_t>();
      if (__builtin_mul_overflow(bytes, v, &bytes) || v > uint64_t(INT64_MAX))
        bad(str(where, "shape ", sh.dump(), " is too large"));
      e.shape.push_back(int64_t(v));
    }

    const json& off = value["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned() ||
        off[0].get<uint64_t>() > off[1].get<uint64_t>())
      bad(str(where, "data_offsets must be [begin, end] with 0 <= begin <= end; got ", off.dump()));
    e.begin = off[0].get<uint64_t>();
    e.end = off[1].get<uint64_t>();
    if (e.end - e.begin != bytes)
      bad(str(where, "data_offsets [", e.begin, ", ", e.end, ") hold ", e.end - e.begin, " bytes, but dtype ",
              format_name(e.dtype), " and shape ", shape_str(e.shape), " need ", bytes));
    if (e.end > data_size)
      bad(str(where, "data_offsets [", e.begin, ", ", e.end, ") reach past the end of the data (", data_size,
              " bytes after the header): the file is truncated or the offsets are wrong"));
    return e;
  }

  std::string path_;
  uint64_t file_size_ = 0;
  std::ifstream in_;
};

// A CPU, contiguous tensor with t's values (t itself when it already is one).
Tensor host_contiguous(const Tensor& t) {
  Tensor d = t.detach();
  if (!d.is_cuda() && d.is_contiguous()) return d;
  Tensor h = empty(d.shape(), d.dtype(), Device::cpu());
  h.copy_(d);
  return h;
}

}  // namespace

std::map<std::string, Tensor> load_safetensors(const std::string& path) {
  Reader r(path);
  Header h = r.header();
  std::map<std::string, Tensor> out;
  for (const Entry& e : h.entries) out[e.name] = r.tensor(h, e);
  return out;
}

std::map<std::string, std::string> load_safetensors_metadata(const std::string& path) {
  return Reader(path).header().metadata;
}

void save_safetensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<Tensor> data;
  uint64_t pos = 0;
  for (const auto& [name, t] : tensors) {
    LT_CHECK(!name.empty() && name != "__metadata__", "[save_safetensors] tensor names must be non-empty and not ",
             "\"__metadata__\"; got \"", name, "\"");
    LT_CHECK(t.defined(), "[save_safetensors] tensor '", name, "' is undefined");
    data.push_back(host_contiguous(t));
    uint64_t bytes = t.nbytes();
    header[name] = {{"dtype", format_name(t.dtype())},
                    {"shape", t.shape()},
                    {"data_offsets", json::array({pos, pos + bytes})}};
    pos += bytes;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& e) {
    fail(str("[save_safetensors] ", path, ": a tensor name or metadata string is not valid UTF-8 (", e.what(), ")"));
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // keeps the data 8-byte aligned in the file

  // Written under a temporary name and renamed, so that the real name only ever holds a whole file.
  std::string tmp = str(path, ".tmp.", ::getpid());
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  LT_CHECK(f != nullptr, "[save_safetensors] cannot create ", tmp, ": ", std::strerror(errno));
  auto write = [f](const void* p, size_t bytes) { return bytes == 0 || std::fwrite(p, 1, bytes, f) == bytes; };
  uint64_t n = text.size();
  bool ok = write(&n, 8) && write(text.data(), text.size());
  for (const Tensor& t : data) ok = ok && write(t.data(), t.nbytes());
  ok = ok && std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0;
  int err = ok ? 0 : errno;
  if (std::fclose(f) != 0 && ok) {
    ok = false;
    err = errno;
  }
  if (ok && std::rename(tmp.c_str(), path.c_str()) != 0) {
    ok = false;
    err = errno;
  }
  if (!ok) {
    std::remove(tmp.c_str());
    fail(str("[save_safetensors] cannot write ", path, ": ", std::strerror(err)));
  }
}

}  // namespace lintape
