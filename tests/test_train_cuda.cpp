// Deterministic GPU training and the step as a CUDA graph: the weight gradients of the embedding and of
// rms_norm have the same bits on every call, two runs with the same seed give the same losses
// and the same checkpoint bytes, a resumed run continues as the uninterrupted one did, and replayed steps
// equal eager ones, bit for bit, for either mixer (bf16 activations, the default on CUDA), with packed
// documents too (each replay reads its batch's boundaries).
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>
#include "helpers.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/reduce.h"
#include "ops/rms_norm.h"
#include "layers/mixer.h"
#include "train/checkpoint.h"
#include "train/trainer.h"
#include "train_helpers.h"

using namespace lintape;
using namespace lintape::test;

namespace {

// The tiny preset's widths (heads of 64: the fused mixer kernels; smaller heads take the composed paths,
// which copy host tables to the device and so cannot be captured), two layers of one mixer.
TrainConfig config_for(const std::string& corpus, const std::string& mixer) {
  TrainConfig c = micro_train_config(corpus);
  const ModelConfig tiny = ModelConfig::preset("tiny");
  c.model.width = tiny.width;
  c.model.heads = tiny.heads;
  c.model.head_dim = tiny.head_dim;
  c.model.mlp_hidden = tiny.mlp_hidden;
  c.model.tpa_ranks = tiny.tpa_ranks;
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

// The two loss curves side by side, for the failure message.
std::string side_by_side(const std::vector<double>& a, const std::vector<double>& b) {
  std::ostringstream out;
  out.precision(17);
  for (size_t i = 0; i < a.size() || i < b.size(); ++i)
    out << "step " << i + 1 << ": " << (i < a.size() ? a[i] : 0.0) << " " << (i < b.size() ? b[i] : 0.0) << "\n";
  return out.str();
}

std::vector<float> weights(Trainer& t) { return t.model().flat_parameters().to_vector<float>(); }

}  // namespace

TEST_CASE("cuda embedding and rms_norm weight gradients have the same bits on every call" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  // Many repeats of few ids (the sums that atomics would order differently), 16-bit and f32 gradients.
  std::vector<int64_t> ids(4096);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = int64_t((i * 7) % 5);
  const Tensor id = from_vector_i64(ids, {4096}).to(gpu());
  for (DType dt : {DType::BF16, DType::F32}) {
    CAPTURE(dtype_name(dt));
    const Tensor w_cpu = randn({16, 768}, DType::F32, Device::cpu(), 3);
    const Tensor r = randn({4096, 768}, DType::F32, Device::cpu(), 4).to(gpu()).to(dt);
    auto embedding_grad = [&] {
      Tensor w = w_cpu.to(gpu()).to(dt).requires_grad_();
      backward(sum(mul(embedding(w, id), r)));
      return w.grad().to(DType::F32).to_vector<float>();
    };
    const std::vector<float> first = embedding_grad();
    CHECK(embedding_grad() == first);
    // Against the CPU (f32, in position order).
    Tensor w_ref = w_cpu.clone().requires_grad_();
    backward(sum(mul(embedding(w_ref, id.to(Device::cpu())), r.to(DType::F32).to(Device::cpu()))));
    const Tensor got = from_vector(std::vector<double>(first.begin(), first.end()), {16, 768});
    CHECK(rel_error(got, w_ref.grad()) < (dt == DType::F32 ? 1e-5 : 1e-2));
    for (int64_t cols : {128, 768, 4096}) {  // row groups of 16 lanes, one warp, and streamed rows
      CAPTURE(cols);
      const Tensor x = randn({2048, cols}, DType::F32, Device::cpu(), 5).to(gpu()).to(dt);
      const Tensor g = randn({2048, cols}, DType::F32, Device::cpu(), 6).to(gpu()).to(dt);
      auto norm_grad = [&] {
        Tensor w = ones({cols}, dt, gpu()).requires_grad_();
        backward(sum(mul(rms_norm(x, w), g)));
        return w.grad().to(DType::F32).to_vector<float>();
      };
      const std::vector<float> once = norm_grad();
      CHECK(norm_grad() == once);
    }
  }
}

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
    INFO(side_by_side(a.losses, b.losses));
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
    INFO(side_by_side(whole.losses, joined));
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
    c.grad_clip = 0.05;  // every step clips: the graph folds the clip into AdamW, the eager step clips apart
    Trainer graphed(c, on_gpu("", true)), eager(c, on_gpu("", false));
    const TrainResult g = graphed.run(), e = eager.run();
    INFO("graphed: CUDA graph " << g.cuda_graph);
    CHECK(g.cuda_graph == "on");
    CHECK(e.cuda_graph == "off (--no-cuda-graph)");
    REQUIRE(g.losses.size() == 5);
    INFO(side_by_side(g.losses, e.losses));
    CHECK(same_bits(g.losses, e.losses));
    CHECK(weights(graphed) == weights(eager));
    // Validation between replays runs eagerly on the updated weights: the same on both.
    CHECK(graphed.validate().first == eager.validate().first);
  }
}

TEST_CASE("cuda graph with documents: each replay reads its step's boundaries, equal to eager steps" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  TempDir dir("cuda_graph_documents");
  const std::string corpus = write_document_corpus(dir);
  for (const char* mixer : {"fal", "tpa"}) {
    CAPTURE(mixer);
    TrainConfig c = config_for(corpus, mixer);
    c.steps = 5;
    c.documents = "auto";
    Trainer graphed(c, on_gpu("", true)), eager(c, on_gpu("", false));
    const TrainResult g = graphed.run(), e = eager.run();
    INFO("graphed: CUDA graph " << g.cuda_graph);
    CHECK(g.cuda_graph == "on");
    REQUIRE(g.losses.size() == 5);
    INFO(side_by_side(g.losses, e.losses));
    CHECK(same_bits(g.losses, e.losses));
    CHECK(weights(graphed) == weights(eager));
    CHECK(graphed.validate().first == eager.validate().first);
  }
}
