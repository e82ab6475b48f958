// Makes tensors, runs ops and backward, an LRPE op with the usual theta, saves and loads a tensor file,
// and prints what it got. Everything comes from the umbrella header, as in a user's project.
#include <lintape/lintape.h>
#include <cstdio>
#include <string>

int main(int argc, char** argv) {
  using namespace lintape;
  try {
    Tensor x = from_vector({1, 2, 3}, {3});
    x.requires_grad_();
    Tensor loss = sum(mul(x, x));  // sum(x^2): gradient 2x
    backward(loss);
    std::vector<float> g = x.grad().to_vector<float>();

    Tensor q = randn({1, 5, 2, 4}, DType::F32, Device::cpu(), /*seed=*/3);
    Tensor qb = lrpe_cosine(q, lrpe_theta(/*H=*/2, /*E=*/4));

    std::string path = std::string(argc > 1 ? argv[1] : ".") + "/consumer.safetensors";
    save_safetensors(path, {{"grad", x.grad()}});
    double back = load_safetensors(path).at("grad").to_vector<double>()[2];
    std::printf("lintape %s (cuda %d) loss %g grad %g %g %g loaded %g lrpe %s\n", LINTAPE_VERSION_STRING,
                LINTAPE_WITH_CUDA, loss.item(), g[0], g[1], g[2], back, shape_str(qb.shape()).c_str());
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
