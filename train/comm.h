// The ranks of a data-parallel run and what they exchange. One process per device, started by mpirun
// (`mpirun -np 2 lintape train ...`); each rank takes its GPU from its local rank on the node. Two
// backends: MPI for CPU tensors, NCCL for CUDA tensors (its id handed out over MPI). A process started
// without mpirun, or a build without MPI, is a single rank and every collective leaves its input as it is.
//
// Failures end the job instead of hanging it: a collective that does not finish within the timeout
// (default 60 s, LINTAPE_COMM_TIMEOUT_S) aborts the communicator and throws; NCCL's asynchronous errors
// are polled while waiting. mpirun ends the other ranks when one exits with an error.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include "../core/tensor.h"

namespace lintape {

class Communicator {
 public:
  // The job's communicator: set up on first use from the launcher's environment.
  static Communicator& world();

  int rank() const { return rank_; }
  int size() const { return size_; }
  int local_rank() const { return local_rank_; }  // the device index this rank uses
  bool distributed() const { return size_ > 1; }
  // "mpi", "mpi+nccl" or "single".
  std::string backend() const;

  // In place, over a contiguous float32 or float64 tensor: MPI for CPU tensors, NCCL for CUDA tensors
  // (on the tensor's device stream, so it is ordered after the work that produced the tensor).
  void all_reduce_sum(Tensor& t);
  void all_reduce_mean(Tensor& t);  // all_reduce_sum, then divide_by_size
  void divide_by_size(Tensor& t) const;  // a sum over the ranks into their mean (nothing on one rank)
  void broadcast(Tensor& t, int root = 0);
  // The same sum, started without waiting, so that it runs while other work goes on (train/grad_reducer.h):
  // on the CPU an MPI_Iallreduce; on CUDA an NCCL all-reduce on the communicator's own stream, after an
  // event recorded on the tensor's device stream (so after the work queued there so far).
  // wait_started() completes every sum started (under the timeout, polling NCCL's errors) and makes the
  // device stream wait for them. Until then nothing may read or write those tensors, and no other
  // collective may be issued (every rank must issue its collectives in the same order).
  void all_reduce_sum_start(Tensor& t);
  void wait_started();
  // wait_started with no wait on the host: the device stream waits for the sums started on CUDA, so that a
  // captured CUDA graph holds them (forked onto the communicator's stream and joined back by events);
  // a failure shows in the next wait_device. Sums started over CPU tensors are waited for as in wait_started.
  void join_started();
  // The same sum queued on a CUDA tensor's device stream with no wait on the host, so that a captured CUDA
  // graph can hold it (a CPU tensor: all_reduce_sum). A failure or a rank that stops shows in the next
  // wait_device, which waits for everything queued on `device`'s stream so far under the timeout, polling
  // NCCL's errors (a plain wait on one rank).
  void all_reduce_sum_queued(Tensor& t);
  void wait_device(Device device);
  // In place over a buffer of size x n elements, this rank's slice being [rank n, (rank + 1) n):
  // reduce_scatter leaves the sum of every rank's slice in this rank's slice (the rest is scratch);
  // all_gather fills every slice from its rank.
  void reduce_scatter_sum_in_place(Tensor& buffer);
  void all_gather_in_place(Tensor& buffer);
  // Scalars on the host.
  double all_reduce_sum(double value);
  double all_reduce_max(double value);
  void barrier();
  // Throws, on every rank, when `value` differs between ranks: names `what`, this rank's value and the
  // value of rank 0 (a config's JSON, a data file's size, the world size a checkpoint was written with).
  void check_same(const std::string& what, const std::string& value);
  // Ends every rank of the job (after an error on one of them) with `code`.
  [[noreturn]] void abort(int code);

  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

 private:
  Communicator();
  struct Nccl;
  Nccl* nccl_for(const Tensor& t);
  struct Started;  // the collectives started and not yet waited for
  std::unique_ptr<Started> started_;
  // `buffer` as size() equal slices (checked), marked written; see comm.cpp.
  struct Slices;
  Slices slices_of(Tensor& buffer, const char* op) const;
  int rank_ = 0, size_ = 1, local_rank_ = 0;
  bool owns_mpi_ = false;
  Nccl* nccl_ = nullptr;
};

}  // namespace lintape
