// Tensor files: round trips through our own writer, a file made byte by byte from the format's
// description, the bytes our writer produces, and every malformed file the loader must refuse.
#include <unistd.h>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include "core/safetensors.h"
#include "helpers.h"

using namespace lintape;
using lintape::test::check_throws_containing;
namespace fs = std::filesystem;

namespace {

// A file name of its own for each test process, removed at the end of the test.
struct TempFile {
  std::string path;
  explicit TempFile(const std::string& name)
      : path((fs::temp_directory_path() / ("lintape_" + std::to_string(::getpid()) + "_" + name)).string()) {}
  ~TempFile() { std::remove(path.c_str()); }
};

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), std::streamsize(bytes.size()));
  REQUIRE(out.good());
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[size_t(i)] = char((v >> (8 * i)) & 0xff);
  return s;
}

std::string bytes(std::initializer_list<int> b) {
  std::string s;
  for (int v : b) s.push_back(char(v));
  return s;
}

// A file with this header text and these data bytes.
std::string st_file(const std::string& header, const std::string& data) { return le64(header.size()) + header + data; }

void check_load_fails(const std::string& name, const std::string& file_bytes, const std::vector<std::string>& parts) {
  TempFile f(name);
  write_bytes(f.path, file_bytes);
  std::vector<std::string> all = {"[load_safetensors]", f.path};
  all.insert(all.end(), parts.begin(), parts.end());
  check_throws_containing([&] { load_safetensors(f.path); }, all);
}

const char* kOneF32 = R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";

}  // namespace

TEST_CASE("safetensors round trip of every dtype, a 0-d and an empty tensor") {
  std::map<std::string, Tensor> in;
  for (DType t : {DType::F32, DType::BF16, DType::F16, DType::F64})
    in[dtype_name(t)] = randn({3, 5}, t, Device::cpu(), 7);
  in["i32"] = arange(-4, 7, DType::I32);
  in["i64"] = from_vector_i64({int64_t(1) << 40, -3, 0, 5}, {2, 2});
  in["scalar"] = full({}, 2.5, DType::F64);
  in["empty"] = empty({0, 4}, DType::BF16);
  in["transposed"] = randn({4, 3}, DType::F32, Device::cpu(), 8).transpose(0, 1);  // written contiguously
  in["narrowed"] = arange(0, 10, DType::F32).narrow(0, 3, 4);
  TempFile f("roundtrip.safetensors");
  save_safetensors(f.path, in, {{"step", "12"}, {"model", "tiny"}});

  std::map<std::string, Tensor> out = load_safetensors(f.path);
  REQUIRE(out.size() == in.size());
  for (const auto& [name, t] : in) {
    INFO("tensor " << name);
    REQUIRE(out.count(name) == 1);
    const Tensor& u = out[name];
    CHECK(u.dtype() == t.dtype());
    CHECK(u.shape() == t.shape());
    CHECK(!u.is_cuda());
    CHECK(u.is_contiguous());
    CHECK(u.to_vector<double>() == t.to_vector<double>());  // same dtype: bit-exact values
  }
  CHECK(out["scalar"].item() == 2.5);
  CHECK(load_safetensors_metadata(f.path) == std::map<std::string, std::string>{{"step", "12"}, {"model", "tiny"}});
  // Only the real name is left in the folder: the temporary file was renamed.
  for (const auto& entry : fs::directory_iterator(fs::path(f.path).parent_path()))
    CHECK(entry.path().string().find(f.path + ".tmp") == std::string::npos);
}

TEST_CASE("safetensors save replaces an existing file and an empty map saves an empty file") {
  TempFile f("replace.safetensors");
  save_safetensors(f.path, {{"a", ones({3})}});
  save_safetensors(f.path, {{"b", zeros({2})}});
  std::map<std::string, Tensor> out = load_safetensors(f.path);
  CHECK(out.size() == 1);
  CHECK(out.count("b") == 1);
  save_safetensors(f.path, {});
  CHECK(load_safetensors(f.path).empty());
  CHECK(load_safetensors_metadata(f.path).empty());
}

TEST_CASE("safetensors loads a file written by hand from the format's description") {
  // One tensor of each dtype; the header is padded with spaces, as the format allows.
  std::string header =
      R"({"__metadata__":{"format":"pt"},)"
      R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("b":{"dtype":"BF16","shape":[1,2],"data_offsets":[8,12]},)"
      R"("c":{"dtype":"F16","shape":[],"data_offsets":[12,14]},)"
      R"("d":{"dtype":"F64","shape":[1],"data_offsets":[14,22]},)"
      R"("e":{"dtype":"I32","shape":[1],"data_offsets":[22,26]},)"
      R"("f":{"dtype":"I64","shape":[],"data_offsets":[26,34]},)"
      R"("g":{"dtype":"F32","shape":[0,3],"data_offsets":[34,34]}}   )";
  std::string data = bytes({0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x20, 0xc0,  // f32 1.0, -2.5
                            0x80, 0x3f, 0x00, 0xc0,                          // bf16 1.0, -2.0
                            0x00, 0x3e,                                      // f16 1.5
                            0, 0, 0, 0, 0, 0, 0xe0, 0x3f,                    // f64 0.5
                            0x07, 0, 0, 0,                                   // i32 7
                            0xfd, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff});  // i64 -3
  TempFile f("byhand.safetensors");
  write_bytes(f.path, st_file(header, data));
  std::map<std::string, Tensor> t = load_safetensors(f.path);
  REQUIRE(t.size() == 7);
  CHECK(t["a"].dtype() == DType::F32);
  CHECK(t["a"].to_vector<double>() == std::vector<double>{1.0, -2.5});
  CHECK(t["b"].dtype() == DType::BF16);
  CHECK(t["b"].shape() == Shape{1, 2});
  CHECK(t["b"].to_vector<double>() == std::vector<double>{1.0, -2.0});
  CHECK(t["c"].dtype() == DType::F16);
  CHECK(t["c"].dim() == 0);
  CHECK(t["c"].item() == 1.5);
  CHECK(t["d"].item() == 0.5);
  CHECK(t["e"].dtype() == DType::I32);
  CHECK(t["e"].item() == 7);
  CHECK(t["f"].dtype() == DType::I64);
  CHECK(t["f"].item() == -3);
  CHECK(t["g"].shape() == Shape{0, 3});
  CHECK(load_safetensors_metadata(f.path) == std::map<std::string, std::string>{{"format", "pt"}});
}

TEST_CASE("safetensors writes the bytes the format describes") {
  TempFile f("bytes.safetensors");
  save_safetensors(f.path, {{"x", from_vector({1.0, -2.5}, {2}, DType::F32)}, {"y", full({}, -3.0, DType::I64)}},
                   {{"k", "v"}});
  std::string file = read_bytes(f.path);
  REQUIRE(file.size() >= 8);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | uint8_t(file[size_t(i)]);
  CHECK(n % 8 == 0);  // the data starts 8-byte aligned
  REQUIRE(file.size() == 8 + n + 16);
  nlohmann::json h = nlohmann::json::parse(file.substr(8, n));
  CHECK(h["__metadata__"] == nlohmann::json{{"k", "v"}});
  CHECK(h["x"]["dtype"] == "F32");
  CHECK(h["x"]["shape"] == nlohmann::json::array({2}));
  CHECK(h["x"]["data_offsets"] == nlohmann::json::array({0, 8}));
  CHECK(h["y"]["dtype"] == "I64");
  CHECK(h["y"]["shape"] == nlohmann::json::array());
  CHECK(h["y"]["data_offsets"] == nlohmann::json::array({8, 16}));
  CHECK(file.substr(8 + n) == bytes({0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x20, 0xc0,  //
                                     0xfd, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}));
}

TEST_CASE("bad input safetensors: missing file") {
  TempFile f("missing.safetensors");
  check_throws_containing([&] { load_safetensors(f.path); }, {"[load_safetensors]", f.path, "no such file"});
}

TEST_CASE("bad input safetensors: shorter than the 8-byte header length") {
  check_load_fails("short.safetensors", bytes({1, 0, 0}), {"has 3 bytes", "8-byte header length"});
}

TEST_CASE("bad input safetensors: header length beyond the file") {
  check_load_fails("hlen.safetensors", le64(1000) + "{}", {"header length 1000", "beyond the end of the file"});
}

TEST_CASE("bad input safetensors: header is not valid JSON") {
  check_load_fails("json.safetensors", st_file(R"({"x": {"dtype": )", ""), {"not valid JSON"});
  check_load_fails("array.safetensors", st_file("[1, 2]", ""), {"must be a JSON object", "array"});
}

TEST_CASE("bad input safetensors: unknown dtype") {
  check_load_fails("dtype.safetensors", st_file(R"({"x":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", "ab"),
                   {"tensor 'x'", "unknown dtype \"U8\"", "expected one of F32, BF16"});
}

TEST_CASE("bad input safetensors: entry without shape or with a negative size") {
  check_load_fails("noshape.safetensors", st_file(R"({"x":{"dtype":"F32","data_offsets":[0,4]}})", "abcd"),
                   {"tensor 'x'", "missing \"shape\""});
  check_load_fails("negshape.safetensors", st_file(R"({"x":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", "abcd"),
                   {"tensor 'x'", "non-negative integers", "[-1]"});
}

TEST_CASE("bad input safetensors: shape and offsets disagree") {
  check_load_fails("mismatch.safetensors",
                   st_file(R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", std::string(8, 'a')),
                   {"tensor 'x'", "hold 8 bytes", "shape (3) need 12"});
}

TEST_CASE("bad input safetensors: offsets out of bounds") {
  check_load_fails("oob.safetensors",
                   st_file(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", std::string(8, 'a')),
                   {"tensor 'x'", "[8, 16)", "past the end of the data (8 bytes"});
  check_load_fails("reversed.safetensors",
                   st_file(R"({"x":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", std::string(8, 'a')),
                   {"tensor 'x'", "0 <= begin <= end", "[8,0]"});
}

TEST_CASE("bad input safetensors: overlapping tensors") {
  check_load_fails("overlap.safetensors",
                   st_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                           R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                           std::string(12, 'a')),
                   {"'a' [0, 8)", "'b' [4, 12)", "overlap"});
}

TEST_CASE("bad input safetensors: bytes that belong to no tensor") {
  check_load_fails("hole.safetensors",
                   st_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", std::string(8, 'a')),
                   {"bytes [0, 4) belong to no tensor"});
  check_load_fails("trailing.safetensors", st_file(kOneF32, std::string(12, 'a')),
                   {"4 bytes after the last tensor"});
}

TEST_CASE("bad input safetensors: truncated data") {
  TempFile f("whole.safetensors");
  save_safetensors(f.path, {{"w", randn({4, 4})}});
  std::string whole = read_bytes(f.path);
  check_load_fails("truncated.safetensors", whole.substr(0, whole.size() - 5),
                   {"tensor 'w'", "past the end of the data", "truncated"});
  check_load_fails("cut_header.safetensors", whole.substr(0, 20), {"beyond the end of the file"});
}

TEST_CASE("bad input safetensors: metadata must map strings to strings") {
  check_load_fails("meta.safetensors", st_file(R"({"__metadata__":{"step":12}})", ""),
                   {"__metadata__ entry 'step' must be a string", "number"});
}

TEST_CASE("bad input safetensors: save with a reserved name or into a missing folder") {
  TempFile f("reserved.safetensors");
  check_throws_containing([&] { save_safetensors(f.path, {{"__metadata__", ones({1})}}); },
                          {"[save_safetensors]", "not \"__metadata__\""});
  check_throws_containing([&] { save_safetensors(f.path, {{"x", Tensor()}}); },
                          {"[save_safetensors]", "tensor 'x' is undefined"});
  CHECK(!fs::exists(f.path));
  std::string missing = f.path + ".dir/w.safetensors";
  check_throws_containing([&] { save_safetensors(missing, {{"x", ones({1})}}); },
                          {"[save_safetensors]", "cannot create", "No such file"});
}

TEST_CASE("cuda safetensors saves tensors of the GPU" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  Tensor a = randn({37, 5}, DType::BF16, lintape::test::gpu(), 3);
  Tensor b = randn({6, 4}, DType::F32, lintape::test::gpu(), 4).transpose(0, 1);
  TempFile f("cuda.safetensors");
  save_safetensors(f.path, {{"a", a}, {"b", b}});
  std::map<std::string, Tensor> out = load_safetensors(f.path);
  CHECK(out["a"].to_vector<double>() == a.to_vector<double>());
  CHECK(out["b"].shape() == Shape{4, 6});
  CHECK(out["b"].to_vector<double>() == b.to_vector<double>());
}
