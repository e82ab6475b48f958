#include "autograd/tape.h"
#include <algorithm>
#include <unordered_map>
#include <unordered_set>
#include "core/kernels.h"

namespace lintape::autograd {
namespace {

thread_local bool t_grad_enabled = true;
thread_local std::vector<std::weak_ptr<Node>> t_tape;
thread_local uint64_t t_next_seq = 0;
thread_local size_t t_compact_at = 1024;
thread_local BackwardObserver t_observer;
thread_local ForwardObserver t_forward_observer;

void compact_tape() {
  t_tape.erase(std::remove_if(t_tape.begin(), t_tape.end(),
                              [](const std::weak_ptr<Node>& w) {
                                auto n = w.lock();
                                return !n || n->released;
                              }),
               t_tape.end());
  t_compact_at = std::max<size_t>(1024, 2 * t_tape.size());
}

// slot += g: in place when the slot alone holds its gradient's storage, else out of place, so that a
// gradient tensor handed to two consumers is never written twice.
void add_into(Tensor& slot, const Tensor& g) {
  if (!slot.defined()) {
    slot = g;
    return;
  }
  const bool sole = slot.impl_ptr().use_count() == 1 && slot.impl()->storage.use_count() == 1;
  if (sole && slot.dtype() == g.dtype()) {
    accumulate_(slot, g);
    return;
  }
  Tensor sum = empty(slot.shape(), slot.dtype(), slot.device());
  sum.copy_(slot);
  accumulate_(sum, g);
  slot = sum;
}

void accumulate_leaf(TensorImpl& leaf, const Tensor& g) {
  if (!leaf.grad) {
    // Take ownership when nobody else holds the gradient's storage; copy otherwise.
    bool sole = g.impl_ptr().use_count() == 1 && g.impl()->storage.use_count() == 1 &&
                g.device() == leaf.storage->device && g.is_contiguous() && g.dtype() == leaf.dtype;
    Tensor own = sole ? g.detach() : empty(leaf.shape, leaf.dtype, leaf.storage->device);
    if (!sole) own.copy_(g);
    leaf.grad = own.impl_ptr();
    return;
  }
  // A float32 leaf adds a 16-bit gradient in one pass (parameters used through their compute copy).
  const bool direct = g.dtype() == leaf.dtype || (leaf.dtype == DType::F32 && is_float16(g.dtype()));
  accumulate_(Tensor(leaf.grad), direct ? g : g.to(leaf.dtype));
}

[[noreturn]] void fail_released(const Node& n) {
  fail(str("[backward] through '", n.name, "' a second time: its saved tensors were freed by the first ",
           "backward; pass retain_graph=true to the first call to keep them"));
}

// Counts, for each leaf, the edges into it from the nodes reached from `root`, and reports a leaf when the
// walk has passed the last of them. Producers precede their consumers on the tape, so one reverse sweep
// finds every node reached from the root.
class LeafCounter {
 public:
  LeafCounter(const std::vector<const Node*>& roots, const LeafReadyFn& ready) : ready_(ready) {
    if (!ready_) return;
    reached_.insert(roots.begin(), roots.end());
    for (size_t i = t_tape.size(); i-- > 0;) {
      std::shared_ptr<Node> node = t_tape[i].lock();
      if (!node || !reached_.count(node.get())) continue;
      for (const Edge& e : node->inputs)
        if (e.node)
          reached_.insert(e.node.get());
        else if (e.leaf)
          ++pending_[e.leaf.get()];
    }
  }
  // After the walk has run `node` (its leaf gradients added) or passed it without a gradient.
  void passed(const Node& node) {
    if (!ready_ || !reached_.count(&node)) return;
    for (const Edge& e : node.inputs)
      if (e.leaf && --pending_[e.leaf.get()] == 0) ready_(Tensor(e.leaf));
  }

 private:
  const LeafReadyFn& ready_;
  std::unordered_set<const Node*> reached_;
  std::unordered_map<const TensorImpl*, int> pending_;
};

}  // namespace

bool grad_enabled() { return t_grad_enabled; }
NoGradGuard::NoGradGuard() : prev_(t_grad_enabled) { t_grad_enabled = false; }
NoGradGuard::~NoGradGuard() { t_grad_enabled = prev_; }

bool needs_grad(const std::vector<Tensor>& inputs) {
  if (!t_grad_enabled) return false;
  for (const Tensor& t : inputs)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}
bool needs_grad(std::initializer_list<Tensor> inputs) { return needs_grad(std::vector<Tensor>(inputs)); }

void record(const char* name, const std::vector<Input>& inputs, const std::vector<Tensor>& outputs,
            BackwardFn fn) {
  if (!t_grad_enabled) return;
  bool any = false;
  for (const Input& in : inputs) any = any || (in.tensor.defined() && in.tensor.requires_grad());
  if (!any) return;
  if (t_forward_observer) t_forward_observer(name);

  auto node = std::make_shared<Node>();
  node->name = name;
  node->seq = t_next_seq++;
  node->has_backward = static_cast<bool>(fn);
  node->backward = std::move(fn);
  node->grad_slots.resize(outputs.size());
  for (const Input& in : inputs) {
    Edge e;
    if (in.tensor.defined() && in.tensor.requires_grad()) {
      e.shape = in.tensor.shape();
      e.dtype = in.tensor.dtype();
      if (in.nondiff)
        e.nondiff = in.nondiff;
      else if (in.tensor.is_leaf())
        e.leaf = in.tensor.impl_ptr();
      else {
        e.node = in.tensor.grad_fn();
        e.output_index = in.tensor.impl()->output_index;
      }
    }
    node->inputs.push_back(std::move(e));
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    TensorImpl* out = outputs[i].impl();
    out->requires_grad = true;
    out->grad_fn = node;
    out->output_index = int(i);
  }
  t_tape.push_back(node);
  if (t_tape.size() >= t_compact_at) compact_tape();
}

namespace {
void check_seed(const Tensor& out, const Tensor& seed) {
  LT_CHECK(seed.defined() && seed.shape() == out.shape() && seed.dtype() == out.dtype() &&
               seed.device() == out.device(),
           "[backward] expected grad_output like the loss: ", shape_str(out.shape()), " ", dtype_name(out.dtype()),
           " on ", out.device().name(), "; got ",
           seed.defined() ? str(shape_str(seed.shape()), " ", dtype_name(seed.dtype()), " on ", seed.device().name())
                          : std::string("an undefined tensor"));
}
}  // namespace

void backward(const Tensor& loss, const Tensor& grad_output, bool retain_graph, const LeafReadyFn& on_leaf_ready) {
  LT_CHECK(loss.defined(), "[backward] the loss is an undefined tensor");
  LT_CHECK(loss.requires_grad(), "[backward] expected a loss that requires grad; this one does not (no input of ",
           "the ops that made it requires grad, or it was computed under NoGradGuard)");
  Tensor seed = grad_output;
  if (!seed.defined()) {
    LT_CHECK(loss.numel() == 1, "[backward] a loss of shape ", shape_str(loss.shape()),
             " needs an explicit grad_output (only one-element losses default to 1)");
    seed = ones(loss.shape(), loss.dtype(), loss.device());
  }
  if (loss.is_leaf()) {
    check_seed(loss, seed);
    accumulate_leaf(*loss.impl(), seed);
    if (on_leaf_ready) on_leaf_ready(loss);
    return;
  }
  backward(std::vector<Tensor>{loss}, std::vector<Tensor>{seed}, retain_graph, on_leaf_ready);
}

void backward(const std::vector<Tensor>& outputs, const std::vector<Tensor>& grad_outputs, bool retain_graph,
              const LeafReadyFn& on_leaf_ready) {
  LT_CHECK(!outputs.empty() && outputs.size() == grad_outputs.size(), "[backward] expected one grad_output per ",
           "output; got ", outputs.size(), " outputs and ", grad_outputs.size(), " grad_outputs");
  std::shared_ptr<Node> root;  // the latest node that made an output: the walk starts there
  std::vector<const Node*> roots;
  for (size_t i = 0; i < outputs.size(); ++i) {
    const Tensor& out = outputs[i];
    LT_CHECK(out.defined() && out.requires_grad() && !out.is_leaf(), "[backward] output ", i,
             " must be made by a recorded op (defined, requiring grad, not a leaf)");
    check_seed(out, grad_outputs[i]);
    std::shared_ptr<Node> node = out.grad_fn();
    if (node->released) fail_released(*node);
    add_into(node->grad_slots[size_t(out.impl()->output_index)], grad_outputs[i]);
    roots.push_back(node.get());
    if (!root || node->seq > root->seq) root = node;
  }

  NoGradGuard no_grad;
  LeafCounter leaves(roots, on_leaf_ready);
  for (size_t i = t_tape.size(); i-- > 0;) {
    std::shared_ptr<Node> node = t_tape[i].lock();
    if (!node || node->seq > root->seq) continue;
    bool has_grad = false;
    for (const Tensor& g : node->grad_slots) has_grad = has_grad || g.defined();
    if (!has_grad) {
      leaves.passed(*node);
      continue;
    }
    if (node->released) fail_released(*node);
    if (!node->has_backward) fail(str("[", node->name, "] has no backward: no gradient can flow through it"));
    for (const Edge& e : node->inputs)
      if (e.nondiff)
        fail(str("[", node->name, "] has no gradient for its input '", e.nondiff,
                 "' (not differentiable), but that input requires grad; detach() it or pass one that does not"));

    if (t_observer) t_observer(node->name.c_str(), true);
    Grads gouts = std::move(node->grad_slots);
    node->grad_slots.assign(gouts.size(), Tensor());
    Grads gins = node->backward(gouts);
    LT_CHECK(gins.size() == node->inputs.size(), "[", node->name, "] backward returned ", gins.size(),
             " gradients for ", node->inputs.size(), " inputs");
    for (size_t k = 0; k < gins.size(); ++k) {
      const Edge& e = node->inputs[k];
      const Tensor& g = gins[k];
      if (!g.defined() || !e.wants_grad()) continue;
      LT_CHECK(g.shape() == e.shape, "[", node->name, "] backward returned a gradient of shape ",
               shape_str(g.shape()), " for input ", k, " of shape ", shape_str(e.shape));
      if (e.node) {
        // A released node is off the tape already: fail here rather than drop the gradient.
        if (e.node->released) fail_released(*e.node);
        add_into(e.node->grad_slots[size_t(e.output_index)], g);
      } else
        accumulate_leaf(*e.leaf, g);
    }
    if (t_observer) t_observer(node->name.c_str(), false);
    if (!retain_graph) {
      node->backward = nullptr;  // frees the saved context
      node->released = true;
    }
    leaves.passed(*node);
  }
  compact_tape();
}

void set_backward_observer(BackwardObserver observer) { t_observer = std::move(observer); }
void set_forward_observer(ForwardObserver observer) { t_forward_observer = std::move(observer); }

size_t tape_size() {
  compact_tape();
  return t_tape.size();
}

}  // namespace lintape::autograd
