// Tape-based reverse-mode autograd.
//
// Every op that touches a tensor requiring grad (while grad mode is on) calls record(): it appends a
// Node to the tape with the op's name, an edge per input (to the node that produced it, or to the leaf
// itself), and the backward function, whose lambda captures are the saved context (tensors saved with
// detach(), plus any statistics). backward(loss) walks the tape in reverse execution order, hands each
// node the gradients of its outputs, routes the returned input gradients along the edges, accumulates
// into the leaves' .grad (+=), and releases each node's saved context unless retain_graph is set.
//
// Nodes are owned by the tensors they produced (grad_fn) and by the edges of later nodes; the tape
// only orders them. A node whose outputs all died before backward can receive no gradient and is gone.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>
#include "../core/tensor.h"

namespace lintape::autograd {

using Grads = std::vector<Tensor>;
// Gets one gradient per output (undefined when none reached it) and returns one per input (undefined
// for an input that gets none). Runs with grad mode off.
using BackwardFn = std::function<Grads(const Grads& grad_outputs)>;

struct Node;

struct Edge {
  std::shared_ptr<Node> node;        // producer of a non-leaf input
  int output_index = 0;              // which of the producer's outputs
  std::shared_ptr<TensorImpl> leaf;  // a leaf input that requires grad
  const char* nondiff = nullptr;     // name of an input that has no gradient and requires one
  Shape shape;                       // expected gradient shape, checked when one arrives
  DType dtype = DType::F32;
  bool wants_grad() const { return node || leaf || nondiff; }
};

struct Node {
  std::string name;
  uint64_t seq = 0;  // position in execution order
  std::vector<Edge> inputs;
  BackwardFn backward;              // empty after release, or for ops without a backward
  bool has_backward = true;
  bool released = false;
  std::vector<Tensor> grad_slots;   // one per output, filled during backward
};

// An input to record(): differentiable, or marked with nondiff(t, "name") when the op has no gradient
// for it (indices, theta, positions). Asking for such a gradient fails with the op's and input's name.
struct Input {
  Tensor tensor;
  const char* nondiff = nullptr;
  Input(const Tensor& t) : tensor(t) {}  // NOLINT: implicit, so {x, y} works
  Input(const Tensor& t, const char* name) : tensor(t), nondiff(name) {}
};
inline Input nondiff(const Tensor& t, const char* name) { return Input(t, name); }

bool grad_enabled();

struct NoGradGuard {
  NoGradGuard();
  ~NoGradGuard();
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool prev_;
};

// True when grad mode is on and any of the inputs requires grad: the op must record itself.
bool needs_grad(std::initializer_list<Tensor> inputs);
bool needs_grad(const std::vector<Tensor>& inputs);

// Records an op if needs_grad(inputs); marks the outputs as requiring grad and produced by it.
// Pass fn = nullptr for an op without a backward: backward through it then fails with its name.
void record(const char* name, const std::vector<Input>& inputs, const std::vector<Tensor>& outputs,
            BackwardFn fn);

// Told during backward that a leaf's .grad is final for this pass: called once for each leaf that some
// node reached from the loss takes as input, right after the last of those nodes has run (or been
// passed without a gradient), so a leaf used twice (a tied weight) is reported after its second use.
// The order follows the graph only, the same for every pass over the same graph.
using LeafReadyFn = std::function<void(const Tensor& leaf)>;

// Reverse-mode pass from loss. grad_output defaults to 1 for a one-element loss.
void backward(const Tensor& loss, const Tensor& grad_output = {}, bool retain_graph = false,
              const LeafReadyFn& on_leaf_ready = {});
// One pass from several outputs of recorded ops at once (each with its gradient), e.g. both outputs of
// one node: each node runs once, with all of its outputs' gradients.
void backward(const std::vector<Tensor>& outputs, const std::vector<Tensor>& grad_outputs,
              bool retain_graph = false, const LeafReadyFn& on_leaf_ready = {});

size_t tape_size();  // live nodes on this thread's tape (for tests and leak checks)

// For profilers: called on this thread around each node's backward (the op's name; begin true before
// the node's backward, false after its gradients are passed on). An empty function removes it.
using BackwardObserver = std::function<void(const char* op, bool begin)>;
void set_backward_observer(BackwardObserver observer);

// For profilers: called on this thread each time an op records a node on the tape, right after its
// forward work was issued (work that records nothing, such as a view or an op on tensors that need no
// gradient, runs before the next call and counts towards it). An empty function removes it.
using ForwardObserver = std::function<void(const char* op)>;
void set_forward_observer(ForwardObserver observer);

}  // namespace lintape::autograd

namespace lintape {
using autograd::backward;
using autograd::NoGradGuard;
}  // namespace lintape
