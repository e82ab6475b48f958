#include "train/checkpoint.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "core/config.h"
#include "core/safetensors.h"
#include "core/sha256.h"

namespace lintape {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string step_name(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof(name), "step_%08lld", static_cast<long long>(step));
  return name;
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  LT_CHECK(out.good(), "[checkpoint] cannot write '", path.string(), "'");
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  LT_CHECK(in.good(), "[checkpoint] cannot read '", path.string(), "'");
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

const char* const kTensorFiles[] = {"model.safetensors", "optim.safetensors"};
// The data order state.json records. Before the shuffled windows, a file's data_position counted tokens.
constexpr const char* kDataOrder = "data batches depend only on (seed, position); file windows shuffled";
constexpr const char* kFileOrderInTokens = "data batches depend only on (seed, position)";

// sha256 of state.json's config, train and files sections (nlohmann's dump is canonical: sorted keys).
std::string state_hash(const json& doc) {
  return sha256_hex(json{{"config", doc.at("config")}, {"train", doc.at("train")}, {"files", doc.at("files")}}.dump());
}

}  // namespace

std::string save_checkpoint(const std::string& dir, Module& model,
                            const std::map<std::string, Tensor>& optimizer_state,
                            const TrainConfig& config, const TrainState& state, int64_t keep) {
  const fs::path root(dir);
  fs::create_directories(root);
  const std::string name = step_name(state.step);
  const fs::path tmp = root / (".tmp_" + name), final_dir = root / name;
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  // A failed write (a full disk, an unwritable file) removes its temporary folder, then reports.
  try {
    // The two files are written (with fsync) and hashed at once, each on its own thread.
    auto write_and_hash = [&tmp](const char* file, const std::map<std::string, Tensor>& tensors) {
      const std::string path = (tmp / file).string();
      save_safetensors(path, tensors);
      return sha256_file(path);
    };
    const std::map<std::string, Tensor> model_state = model.state_dict();
    std::future<std::string> optim_hash =
        std::async(std::launch::async, write_and_hash, kTensorFiles[1], std::cref(optimizer_state));
    json files;
    files[kTensorFiles[0]] = write_and_hash(kTensorFiles[0], model_state);
    files[kTensorFiles[1]] = optim_hash.get();  // rethrows the thread's error, if any
    const json train{{"step", state.step},
                     {"data_position", state.data_position},
                     {"seed", config.seed},
                     {"lr_schedule",
                      {{"peak", config.lr},
                       {"warmup", config.warmup},
                       {"total_steps", config.steps},
                       {"min_lr_ratio", config.min_lr_ratio}}},
                     {"rng", {{"kind", kDataOrder}}}};
    json doc{{"config", json::parse(to_json(config))}, {"train", train}, {"files", files}};
    doc["state_sha256"] = state_hash(doc);
    doc["lintape"] = LINTAPE_VERSION_STRING;
    write_text(tmp / "state.json", doc.dump(2));
  } catch (...) {
    std::error_code ignored;
    fs::remove_all(tmp, ignored);
    throw;
  }
  fs::remove_all(final_dir);
  fs::rename(tmp, final_dir);
  write_text(root / "latest.tmp", name + "\n");
  fs::rename(root / "latest.tmp", root / "latest");

  std::vector<std::string> steps;
  for (const auto& entry : fs::directory_iterator(root)) {
    const std::string n = entry.path().filename().string();
    if (entry.is_directory() && n.rfind("step_", 0) == 0) steps.push_back(n);
  }
  std::sort(steps.begin(), steps.end());
  for (size_t i = 0; i + size_t(std::max<int64_t>(keep, 1)) < steps.size(); ++i) fs::remove_all(root / steps[i]);
  return final_dir.string();
}

namespace {

// The step directory DIR names and its parsed state.json.
std::pair<fs::path, json> read_state(const std::string& dir) {
  fs::path step_dir(dir);
  if (fs::exists(step_dir / "latest")) {
    std::string name = read_text(step_dir / "latest");
    name.erase(std::remove_if(name.begin(), name.end(), [](char c) { return c == '\n' || c == '\r'; }), name.end());
    LT_CHECK(name.rfind("step_", 0) == 0, "[checkpoint] '", (step_dir / "latest").string(),
             "' does not name a step directory; got '", name, "'");
    step_dir /= name;
  }
  const fs::path state_path = step_dir / "state.json";
  LT_CHECK(fs::exists(state_path), "[checkpoint] no checkpoint at '", dir, "': '", state_path.string(),
           "' does not exist");
  json doc;
  std::string expected, got;
  try {
    doc = json::parse(read_text(state_path));
    // Checkpoints written before the state's checksum have none: their config is still validated.
    if (doc.contains("state_sha256")) {
      expected = doc.at("state_sha256").get<std::string>();
      got = state_hash(doc);
    }
  } catch (const json::exception& e) {
    fail(str("[checkpoint] '", state_path.string(), "' is corrupt or truncated: ", e.what()));
  }
  LT_CHECK(got == expected, "[checkpoint] '", state_path.string(), "' was edited or corrupted: sha256 of its config, "
           "train and files ", got, "; it records ", expected);
  return {step_dir, doc};
}

}  // namespace

void check_checkpoint_dir_writable(const std::string& dir) {
  const fs::path root(dir);
  std::error_code ec;
  fs::create_directories(root, ec);
  LT_CHECK(!ec, "[checkpoint] cannot create the checkpoint directory '", dir, "': ", ec.message());
  const fs::path probe = root / ".write_check";
  {
    std::ofstream out(probe, std::ios::binary | std::ios::trunc);
    out << std::string(4096, '\0');
    out.close();
    const bool good = out.good();
    if (!good) fs::remove(probe, ec);
    LT_CHECK(good, "[checkpoint] cannot write in the checkpoint directory '", dir, "': ", std::strerror(errno));
  }
  fs::remove(probe, ec);
  LT_CHECK(!ec, "[checkpoint] cannot remove '", probe.string(), "': ", ec.message());
}

Checkpoint load_checkpoint_state(const std::string& dir) {
  const auto [step_dir, doc] = read_state(dir);
  const std::string state_path = (step_dir / "state.json").string();
  Checkpoint c;
  c.path = step_dir.string();
  try {
    // The config (its sizes checked against overflow and memory) before any file is read or allocated.
    c.config = train_config_from_json(doc.at("config").dump(), state_path);
    c.state.step = doc.at("train").at("step").get<int64_t>();
    c.state.data_position = doc.at("train").at("data_position").get<int64_t>();
    // An older checkpoint of a file run: its token offset becomes the count of windows read so far.
    const json& rng = doc.at("train").at("rng");
    if (c.config.data != "mqar" && rng.is_object() && rng.value("kind", "") == kFileOrderInTokens)
      c.state.data_position /= c.config.model.seq_len;
  } catch (const json::exception& e) {
    fail(str("[checkpoint] '", state_path, "' lacks a field: ", e.what()));
  }
  LT_CHECK(c.state.step >= 0 && c.state.data_position >= 0, "[checkpoint] '", state_path,
           "': step and data_position must not be negative; got ", c.state.step, ", ", c.state.data_position);
  return c;
}

Checkpoint load_checkpoint(const std::string& dir) {
  Checkpoint c = load_checkpoint_state(dir);
  const fs::path step_dir(c.path);
  const json doc = json::parse(read_text(step_dir / "state.json"));
  try {
    for (const char* f : kTensorFiles) {
      const std::string path = (step_dir / f).string();
      LT_CHECK(fs::exists(path), "[checkpoint] '", path, "' is missing");
      const std::string expected = doc.at("files").at(f).get<std::string>();
      const std::string got = sha256_file(path);
      LT_CHECK(got == expected, "[checkpoint] '", path, "' is corrupt or truncated: sha256 ", got,
               "; state.json records ", expected);
    }
  } catch (const json::exception& e) {
    fail(str("[checkpoint] '", (step_dir / "state.json").string(), "' lacks a field: ", e.what()));
  }
  c.model = load_safetensors((step_dir / kTensorFiles[0]).string());
  c.optim = load_safetensors((step_dir / kTensorFiles[1]).string());
  // A diverged run's weights (written before the trainer checked them) would evaluate to NaN.
  for (const auto& [name, tensor] : c.model) {
    const std::vector<float> values = tensor.to(DType::F32).to_vector<float>();
    const auto bad = std::find_if(values.begin(), values.end(), [](float v) { return !std::isfinite(v); });
    LT_CHECK(bad == values.end(), "[checkpoint] '", (step_dir / kTensorFiles[0]).string(), "': ", name, " holds ",
             bad == values.end() ? 0.0f : *bad, " at index ", bad - values.begin(),
             "; the run diverged before this checkpoint: take an earlier one");
  }
  return c;
}

}  // namespace lintape
