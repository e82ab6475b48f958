// The collectives of train/comm.h across real processes, blocking and started early: run by ctest as
//   mpirun -np 2 lintape_comm_checks [cuda]
// Every rank checks every result against what it computes alone; the exit status is the number of
// failed checks on this rank (mpirun reports a nonzero status when any rank fails). With `cuda` the
// tensors live on each rank's GPU (NCCL); without, on the CPU (MPI).
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>
#include "core/tensor.h"
#include "ops/elementwise.h"
#include "train/comm.h"

using namespace lintape;

namespace {
int failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "rank %d: FAILED %s\n", Communicator::world().rank(), what.c_str());
    ++failures;
  }
}

Tensor filled(const std::vector<double>& values, DType dtype, Device device) {
  return from_vector(values, {int64_t(values.size())}).to(dtype).to(device);
}

std::vector<double> values_of(const Tensor& t) { return t.to(Device::cpu()).to(DType::F64).to_vector<double>(); }
}  // namespace

int main(int argc, char** argv) {
  Communicator& comm = Communicator::world();
  const int r = comm.rank(), n = comm.size();
  const Device device = argc > 1 && std::string(argv[1]) == "cuda" ? Device::cuda(comm.local_rank()) : Device::cpu();
  expect(n >= 2, "the check runs with at least 2 ranks; got " + std::to_string(n));

  for (DType dtype : {DType::F32, DType::F64}) {
    const std::string tag = std::string(" (") + dtype_name(dtype) + ", " + device.name() + ")";
    // all_reduce: rank r holds (r + 1) * [1, 2, 3, ...]; the sum is n(n + 1)/2 * [1, 2, 3, ...].
    const int64_t len = 1000 + 3;
    std::vector<double> mine(len), sum(len);
    for (int64_t i = 0; i < len; ++i) {
      mine[size_t(i)] = double(r + 1) * double(i + 1);
      sum[size_t(i)] = double(n) * double(n + 1) / 2 * double(i + 1);
    }
    Tensor t = filled(mine, dtype, device);
    comm.all_reduce_sum(t);
    std::vector<double> got = values_of(t);
    bool ok = true;
    for (int64_t i = 0; i < len; ++i) ok = ok && std::fabs(got[size_t(i)] - sum[size_t(i)]) <= 1e-6 * sum[size_t(i)];
    expect(ok, "all_reduce_sum" + tag);

    Tensor m = filled(mine, dtype, device);
    comm.all_reduce_mean(m);
    got = values_of(m);
    ok = true;
    for (int64_t i = 0; i < len; ++i)
      ok = ok && std::fabs(got[size_t(i)] - sum[size_t(i)] / n) <= 1e-6 * sum[size_t(i)];
    expect(ok, "all_reduce_mean" + tag);

    // broadcast from the last rank.
    Tensor b = filled({double(r), double(r) + 0.5}, dtype, device);
    comm.broadcast(b, n - 1);
    got = values_of(b);
    expect(got[0] == n - 1 && got[1] == n - 0.5, "broadcast" + tag);

    // reduce_scatter in place, then all_gather in place, gives back the all_reduce.
    std::vector<double> whole(size_t(4 * n));
    for (size_t i = 0; i < whole.size(); ++i) whole[i] = double(r + 1) + double(i);
    Tensor buffer = filled(whole, dtype, device);
    comm.reduce_scatter_sum_in_place(buffer);
    got = values_of(buffer.narrow(0, 4 * r, 4));
    ok = true;
    for (int64_t i = 0; i < 4; ++i) ok = ok && got[size_t(i)] == double(n) * (double(n + 1) / 2 + double(4 * r + i));
    expect(ok, "reduce_scatter_sum_in_place" + tag);
    comm.all_gather_in_place(buffer);
    got = values_of(buffer);
    ok = true;
    for (size_t i = 0; i < got.size(); ++i) ok = ok && got[i] == double(n) * (double(n + 1) / 2 + double(i));
    expect(ok, "all_gather_in_place" + tag);

    // Sums started without waiting (gradient buckets): three views of one buffer, last one first, then
    // one wait, then a device op on the result. Each element equals the blocking all_reduce_sum's (with
    // two ranks bit for bit: a + b either way).
    const int64_t part = 257;
    std::vector<double> values(size_t(3 * part));
    for (size_t i = 0; i < values.size(); ++i)
      values[i] = double(r + 1) * 0.1 * double(i % 97) + 1.0 / double(i + 1);
    Tensor started = filled(values, dtype, device), blocking = filled(values, dtype, device);
    for (int64_t k = 2; k >= 0; --k) {
      Tensor view = started.narrow(0, k * part, part);
      comm.all_reduce_sum_start(view);
    }
    comm.wait_started();
    comm.all_reduce_sum(blocking);
    const std::vector<double> a = values_of(mul(started, 2.0)), want = values_of(mul(blocking, 2.0));
    ok = true;
    for (size_t i = 0; i < a.size(); ++i)
      ok = ok && (n == 2 ? a[i] == want[i] : std::fabs(a[i] - want[i]) <= 1e-6 * std::fabs(want[i]));
    expect(ok, "all_reduce_sum_start" + tag);
    comm.wait_started();  // nothing started: returns at once
  }

  expect(comm.all_reduce_sum(double(r)) == double(n) * (n - 1) / 2, "scalar all_reduce_sum");
  expect(comm.all_reduce_max(double(r)) == double(n - 1), "scalar all_reduce_max");
  comm.check_same("the model config", "{\"width\": 128}");
  bool threw = false;
  std::string message;
  try {
    comm.check_same("the model config", r == 0 ? "{\"width\": 128}" : "{\"width\": 256}");
  } catch (const Error& e) {
    threw = true;
    message = e.what();
  }
  expect(threw, "check_same throws on every rank when one rank differs");
  if (r == 1) expect(message.find("rank 1 has {\"width\": 256}, rank 0 has {\"width\": 128}") != std::string::npos,
                     "check_same names both values; got: " + message);
  comm.barrier();
  if (r == 0) std::printf("comm checks on %d ranks (%s, %s): %s\n", n, comm.backend().c_str(), device.name().c_str(),
                          failures == 0 ? "all passed" : "FAILED");
  return failures;
}
