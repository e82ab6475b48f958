// Makes tensors, runs ops and backward, saves and loads a tensor file, and prints what it got.
#include <cstdio>
#include <string>
#include "autograd/tape.h"
#include "core/safetensors.h"
#include "core/tensor.h"
#include "ops/elementwise.h"
#include "ops/reduce.h"

int main(int argc, char** argv) {
  using namespace lintape;
  try {
    Tensor x = from_vector({1, 2, 3}, {3});
    x.requires_grad_();
    Tensor loss = sum(mul(x, x));  // sum(x^2): gradient 2x
    backward(loss);
    std::vector<float> g = x.grad().to_vector<float>();

    std::string path = std::string(argc > 1 ? argv[1] : ".") + "/consumer.safetensors";
    save_safetensors(path, {{"grad", x.grad()}});
    double back = load_safetensors(path).at("grad").to_vector<double>()[2];
    std::printf("loss %g grad %g %g %g loaded %g\n", loss.item(), g[0], g[1], g[2], back);
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
