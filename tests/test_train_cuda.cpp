// Deterministic GPU training and the step as a CUDA graph: two runs with the same seed give the same losses
// and the same checkpoint bytes, a resumed run continues as the uninterrupted one did, and replayed steps
// equal eager ones, bit for bit, for either mixer (bf16 activations, the default on CUDA).
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>
#include "helpers.h"
#include "train/checkpoint.h"
#include "train/trainer.h"
#include "train_helpers.h"

using namespace lintape;
using namespace lintape::test;

namespace {

TrainConfig config_for(const std::string& corpus, const std::string& mixer) {
  TrainConfig c = micro_train_config(corpus);
  c.model.mixers = {mixer, mixer};
  c.model.seq_len = 64;
  c.batch = 8;
  c.steps = 6;
  return c;
}

TrainerOptions on_gpu(const std::string& checkpoint_dir = "", bool graph = true) {
  TrainerOptions o;
  o.device = gpu();
  o.checkpoint_dir = checkpoint_dir;
  o.cuda_graph = graph;
  return o;
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in.good());
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// The latest checkpoint's weights and moments, as bytes.
std::string checkpoint_bytes(const std::string& dir) {
  const std::string path = load_checkpoint(dir).path;
  return file_bytes(path + "/model.safetensors") + file_bytes(path + "/optim.safetensors");
}

bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

std::vector<float> weights(Trainer& t) { return t.model().flat_parameters().to_vector<float>(); }

}  // namespace

TEST_CASE("cuda training is deterministic: the same seed gives the same losses and checkpoint bytes" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  TempDir dir("cuda_determinism");
  const std::string corpus = write_text_corpus(dir);
  for (const char* mixer : {"fal", "tpa"}) {
    CAPTURE(mixer);
    const TrainConfig c = config_for(corpus, mixer);
    const std::string a_dir = dir.file(std::string(mixer) + "_a"), b_dir = dir.file(std::string(mixer) + "_b");
    const TrainResult a = Trainer(c, on_gpu(a_dir)).run();
    const TrainResult b = Trainer(c, on_gpu(b_dir)).run();
    REQUIRE(a.losses.size() == 6);
    for (size_t i = 0; i < a.losses.size(); ++i) INFO("step " << i + 1 << ": " << a.losses[i] << " " << b.losses[i]);
    CHECK(same_bits(a.losses, b.losses));
    CHECK(checkpoint_bytes(a_dir) == checkpoint_bytes(b_dir));
  }
}

TEST_CASE("cuda resume continues bit for bit as the uninterrupted run" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  TempDir dir("cuda_resume_bits");
  const std::string corpus = write_text_corpus(dir);
  for (const char* mixer : {"fal", "tpa"}) {
    CAPTURE(mixer);
    const TrainConfig c = config_for(corpus, mixer);
    const std::string whole_dir = dir.file(std::string(mixer) + "_whole");
    const std::string split_dir = dir.file(std::string(mixer) + "_split");
    const TrainResult whole = Trainer(c, on_gpu(whole_dir)).run();
    TrainerOptions first = on_gpu(split_dir);
    first.stop_after = 3;
    const TrainResult head = Trainer(c, first).run();
    REQUIRE(head.losses.size() == 3);
    TrainerOptions rest = on_gpu(split_dir);
    rest.resume = true;
    const TrainResult tail = Trainer(c, rest).run();
    REQUIRE(tail.first_step == 3);
    std::vector<double> joined = head.losses;
    joined.insert(joined.end(), tail.losses.begin(), tail.losses.end());
    for (size_t i = 0; i < joined.size(); ++i) INFO("step " << i + 1 << ": " << whole.losses[i] << " " << joined[i]);
    CHECK(same_bits(whole.losses, joined));
    CHECK(checkpoint_bytes(whole_dir) == checkpoint_bytes(split_dir));
  }
}

TEST_CASE("cuda graph: five replayed steps equal five eager steps bit for bit" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  TempDir dir("cuda_graph_bits");
  const std::string corpus = write_text_corpus(dir);
  for (const char* mixer : {"fal", "tpa"}) {
    CAPTURE(mixer);
    TrainConfig c = config_for(corpus, mixer);
    c.steps = 5;
    Trainer graphed(c, on_gpu("", true)), eager(c, on_gpu("", false));
    const TrainResult g = graphed.run(), e = eager.run();
    INFO("graphed: CUDA graph " << g.cuda_graph);
    CHECK(g.cuda_graph == "on");
    CHECK(e.cuda_graph == "off (--no-cuda-graph)");
    REQUIRE(g.losses.size() == 5);
    for (size_t i = 0; i < g.losses.size(); ++i) INFO("step " << i + 1 << ": " << g.losses[i] << " " << e.losses[i]);
    CHECK(same_bits(g.losses, e.losses));
    CHECK(weights(graphed) == weights(eager));
    // Validation between replays runs eagerly on the updated weights: the same on both.
    CHECK(graphed.validate().first == eager.validate().first);
  }
}
