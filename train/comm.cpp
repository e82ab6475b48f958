#include "train/comm.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "core/error.h"
#include "ops/elementwise.h"
#if LINTAPE_WITH_MPI
#include <mpi.h>
#endif
#if LINTAPE_WITH_CUDA
#include "core/cuda.h"
#endif
#if LINTAPE_WITH_NCCL
#include <cuda_runtime_api.h>
#include <nccl.h>
#endif

namespace lintape {

namespace {

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

double timeout_seconds() {
  const char* v = std::getenv("LINTAPE_COMM_TIMEOUT_S");
  const double s = v && *v ? std::atof(v) : 60.0;
  return s > 0 ? s : 60.0;
}

// A launcher's world size: OpenMPI's, MPICH/Hydra's or Slurm's variable; 1 without a launcher.
int launcher_world_size() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"})
    if (std::getenv(name)) return env_int(name, 1);
  return 1;
}

// Runs `wait` (a blocking collective) with a watchdog: when it has not returned after the timeout, the
// process says so and exits with status 1, which makes mpirun end the other ranks. A rank that died
// leaves the others blocked in a collective; this is what ends them.
template <class F>
void with_watchdog(const char* what, int rank, F&& wait) {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  const double limit = timeout_seconds();
  std::thread dog([&] {
    std::unique_lock<std::mutex> lock(m);
    if (!cv.wait_for(lock, std::chrono::duration<double>(limit), [&] { return done; })) {
      std::fprintf(stderr,
                   "error: [comm] rank %d: %s did not finish within %.0f s (another rank failed or stopped); "
                   "ending this rank\n",
                   rank, what, limit);
      std::fflush(stderr);
      std::_Exit(1);
    }
  });
  try {
    wait();
  } catch (...) {
    {
      std::lock_guard<std::mutex> lock(m);
      done = true;
    }
    cv.notify_all();
    dog.join();
    throw;
  }
  {
    std::lock_guard<std::mutex> lock(m);
    done = true;
  }
  cv.notify_all();
  dog.join();
}

#if LINTAPE_WITH_MPI
void mpi_check(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  fail(str("[comm] ", call, " failed: ", std::string(text, size_t(len))));
}
#define LT_MPI_CHECK(call) mpi_check((call), #call)

MPI_Datatype mpi_type(const Tensor& t, const char* op) {
  switch (t.dtype()) {
    case DType::F32:
      return MPI_FLOAT;
    case DType::F64:
      return MPI_DOUBLE;
    default:
      fail(str("[comm] ", op, " takes float32 or float64 tensors; got ", dtype_name(t.dtype())));
  }
}
#endif

// MPI moves host memory: a CUDA tensor needs the NCCL backend.
void require_host(const Tensor& t, const char* op) {
  LT_CHECK(!t.is_cuda(), "[comm] ", op, " over ", t.device().name(), " tensors needs NCCL; this lintape has MPI only");
}

void check_tensor(const Tensor& t, const char* op) {
  LT_CHECK(t.defined() && t.is_contiguous(), "[comm] ", op, " takes a contiguous tensor");
  LT_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::F64, "[comm] ", op,
           " takes float32 or float64 tensors; got ", dtype_name(t.dtype()));
}

}  // namespace

#if LINTAPE_WITH_NCCL
struct Communicator::Nccl {
  ncclComm_t comm = nullptr;
  int device = 0;
  cudaStream_t stream = nullptr;  // the communicator's own stream, for the collectives started early
  cudaEvent_t ready = nullptr;    // recorded on the device stream before each of them
};

namespace {
void nccl_check(ncclResult_t r, const char* call) {
  if (r == ncclSuccess || r == ncclInProgress) return;
  fail(str("[comm] ", call, " failed: ", ncclGetErrorString(r)));
}
#define LT_NCCL_CHECK(call) nccl_check((call), #call)

ncclDataType_t nccl_type(const Tensor& t) { return t.dtype() == DType::F64 ? ncclFloat64 : ncclFloat32; }

// Waits for the stream's work (the collective just enqueued), polling NCCL's asynchronous errors; past
// the timeout the communicator is aborted and the wait throws.
void nccl_wait(ncclComm_t comm, cudaStream_t stream, const char* what, int rank) {
  cudaEvent_t done;
  LT_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  LT_CUDA_CHECK(cudaEventRecord(done, stream));
  const auto start = std::chrono::steady_clock::now();
  const double limit = timeout_seconds();
  for (;;) {
    const cudaError_t q = cudaEventQuery(done);
    if (q == cudaSuccess) break;
    if (q != cudaErrorNotReady) {
      cudaEventDestroy(done);
      LT_CUDA_CHECK(q);
    }
    ncclResult_t async = ncclSuccess;
    ncclCommGetAsyncError(comm, &async);
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if ((async != ncclSuccess && async != ncclInProgress) || waited > limit) {
      ncclCommAbort(comm);
      std::fprintf(stderr, "error: [comm] rank %d: %s %s; the NCCL communicator was aborted\n", rank, what,
                   async != ncclSuccess && async != ncclInProgress
                       ? (std::string("failed: ") + ncclGetErrorString(async)).c_str()
                       : "did not finish within the timeout (another rank failed or stopped)");
      std::fflush(stderr);
      std::_Exit(1);  // the communicator is gone; mpirun ends the other ranks
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  cudaEventDestroy(done);
}
}  // namespace
#else
struct Communicator::Nccl {};
#endif

struct Communicator::Started {
#if LINTAPE_WITH_MPI
  std::vector<MPI_Request> requests;
#endif
  int cuda_device = -1;  // >= 0: collectives are queued on that device's communicator stream
};

Communicator& Communicator::world() {
  static Communicator c;
  return c;
}

Communicator::Communicator() : started_(std::make_unique<Started>()) {
  const int launched = launcher_world_size();
#if LINTAPE_WITH_MPI
  if (launched > 1) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      LT_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided));
      owns_mpi_ = true;
    }
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    LT_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank_));
    LT_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size_));
    MPI_Comm node;
    LT_MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node));
    LT_MPI_CHECK(MPI_Comm_rank(node, &local_rank_));
    MPI_Comm_free(&node);
  }
#else
  LT_CHECK(launched <= 1, "[comm] started as one of ", launched,
           " ranks, but this lintape was built without MPI; install OpenMPI (scripts/setup.sh) and rebuild");
#endif
}

Communicator::~Communicator() {
#if LINTAPE_WITH_NCCL
  if (nccl_) {
    ncclCommDestroy(nccl_->comm);
    cudaEventDestroy(nccl_->ready);
    cudaStreamDestroy(nccl_->stream);
    delete nccl_;
  }
#endif
#if LINTAPE_WITH_MPI
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (owns_mpi_ && !finalized) MPI_Finalize();
#endif
}

std::string Communicator::backend() const {
  if (!distributed()) return "single";
#if LINTAPE_WITH_NCCL
  return "mpi+nccl";
#else
  return "mpi";
#endif
}

Communicator::Nccl* Communicator::nccl_for(const Tensor& t) {
#if LINTAPE_WITH_NCCL
  LT_CHECK(t.device().index == local_rank_, "[comm] rank ", rank_, " uses cuda:", local_rank_,
           " (its local rank); got a tensor on ", t.device().name());
  if (!nccl_) {
    ncclUniqueId id;
    if (rank_ == 0) LT_NCCL_CHECK(ncclGetUniqueId(&id));
    LT_MPI_CHECK(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD));
    cuda::set_device(local_rank_);
    auto* n = new Nccl;
    n->device = local_rank_;
    LT_NCCL_CHECK(ncclCommInitRank(&n->comm, size_, id, rank_));
    LT_CUDA_CHECK(cudaStreamCreateWithFlags(&n->stream, cudaStreamNonBlocking));
    LT_CUDA_CHECK(cudaEventCreateWithFlags(&n->ready, cudaEventDisableTiming));
    nccl_ = n;
  }
  return nccl_;
#else
  fail(str("[comm] a collective over ", t.device().name(), " tensors needs NCCL; this lintape was built without it"));
#endif
}

void Communicator::all_reduce_sum(Tensor& t) {
  check_tensor(t, "all_reduce");
  if (!distributed() || t.numel() == 0) return;
  t.storage().version++;
#if LINTAPE_WITH_NCCL
  if (t.is_cuda()) {
    Nccl* n = nccl_for(t);
    cudaStream_t s = cuda::stream(t.device().index);
    LT_NCCL_CHECK(ncclAllReduce(t.data(), t.data(), size_t(t.numel()), nccl_type(t), ncclSum, n->comm, s));
    return nccl_wait(n->comm, s, "all_reduce", rank_);
  }
#endif
#if LINTAPE_WITH_MPI
  require_host(t, "all_reduce");
  with_watchdog("all_reduce", rank_, [&] {
    LT_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, t.data(), int(t.numel()), mpi_type(t, "all_reduce"), MPI_SUM,
                               MPI_COMM_WORLD));
  });
#endif
}

void Communicator::all_reduce_sum_queued(Tensor& t) {
#if LINTAPE_WITH_NCCL
  check_tensor(t, "all_reduce");
  if (distributed() && t.numel() > 0 && t.is_cuda()) {
    t.storage().version++;
    LT_NCCL_CHECK(ncclAllReduce(t.data(), t.data(), size_t(t.numel()), nccl_type(t), ncclSum, nccl_for(t)->comm,
                                cuda::stream(t.device().index)));
    return;
  }
#endif
  all_reduce_sum(t);
}

void Communicator::wait_device(Device device) {
#if LINTAPE_WITH_NCCL
  if (distributed() && device.is_cuda() && nccl_)
    return nccl_wait(nccl_->comm, cuda::stream(device.index), "step", rank_);
#endif
#if LINTAPE_WITH_CUDA
  if (device.is_cuda()) cuda::synchronize(device.index);
#else
  (void)device;
#endif
}

void Communicator::all_reduce_sum_start(Tensor& t) {
  check_tensor(t, "all_reduce");
  if (!distributed() || t.numel() == 0) return;
  t.storage().version++;
#if LINTAPE_WITH_NCCL
  if (t.is_cuda()) {
    Nccl* n = nccl_for(t);
    LT_CUDA_CHECK(cudaEventRecord(n->ready, cuda::stream(t.device().index)));
    LT_CUDA_CHECK(cudaStreamWaitEvent(n->stream, n->ready, 0));
    LT_NCCL_CHECK(ncclAllReduce(t.data(), t.data(), size_t(t.numel()), nccl_type(t), ncclSum, n->comm, n->stream));
    started_->cuda_device = t.device().index;
    return;
  }
#endif
#if LINTAPE_WITH_MPI
  require_host(t, "all_reduce");
  MPI_Request request;
  LT_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, t.data(), int(t.numel()), mpi_type(t, "all_reduce"), MPI_SUM,
                              MPI_COMM_WORLD, &request));
  std::vector<MPI_Request>& pending = started_->requests;
  pending.push_back(request);
  // Without a progress thread, MPI moves nonblocking collectives on only inside MPI calls: give it one.
  int all_done = 0;
  LT_MPI_CHECK(MPI_Testall(int(pending.size()), pending.data(), &all_done, MPI_STATUSES_IGNORE));
#endif
}

void Communicator::wait_started() {
#if LINTAPE_WITH_NCCL
  if (started_->cuda_device >= 0) {
    Nccl* n = nccl_;
    started_->cuda_device = -1;
    nccl_wait(n->comm, n->stream, "all_reduce", rank_);
    // The host has seen them finish; the device stream's own wait orders it after them regardless.
    LT_CUDA_CHECK(cudaEventRecord(n->ready, n->stream));
    LT_CUDA_CHECK(cudaStreamWaitEvent(cuda::stream(n->device), n->ready, 0));
  }
#endif
#if LINTAPE_WITH_MPI
  std::vector<MPI_Request>& pending = started_->requests;
  if (pending.empty()) return;
  with_watchdog("all_reduce", rank_, [&] {
    LT_MPI_CHECK(MPI_Waitall(int(pending.size()), pending.data(), MPI_STATUSES_IGNORE));
  });
  pending.clear();
#endif
}

void Communicator::join_started() {
#if LINTAPE_WITH_NCCL
  if (started_->cuda_device >= 0) {
    Nccl* n = nccl_;
    started_->cuda_device = -1;
    LT_CUDA_CHECK(cudaEventRecord(n->ready, n->stream));
    LT_CUDA_CHECK(cudaStreamWaitEvent(cuda::stream(n->device), n->ready, 0));
  }
#endif
  wait_started();  // what is left: sums over CPU tensors
}

void Communicator::all_reduce_mean(Tensor& t) {
  all_reduce_sum(t);
  divide_by_size(t);
}

void Communicator::divide_by_size(Tensor& t) const {
  if (distributed()) t.copy_(mul(t.detach(), 1.0 / double(size_)));
}

void Communicator::broadcast(Tensor& t, int root) {
  check_tensor(t, "broadcast");
  if (!distributed() || t.numel() == 0) return;
  t.storage().version++;
#if LINTAPE_WITH_NCCL
  if (t.is_cuda()) {
    Nccl* n = nccl_for(t);
    cudaStream_t s = cuda::stream(t.device().index);
    LT_NCCL_CHECK(ncclBroadcast(t.data(), t.data(), size_t(t.numel()), nccl_type(t), root, n->comm, s));
    return nccl_wait(n->comm, s, "broadcast", rank_);
  }
#endif
#if LINTAPE_WITH_MPI
  require_host(t, "broadcast");
  with_watchdog("broadcast", rank_, [&] {
    LT_MPI_CHECK(MPI_Bcast(t.data(), int(t.numel()), mpi_type(t, "broadcast"), root, MPI_COMM_WORLD));
  });
#else
  (void)root;
#endif
}

// A flat buffer seen as `ranks` equal slices; `mine` is this rank's.
struct Communicator::Slices {
  size_t count, bytes;  // elements per slice, bytes per element
  char *base, *mine;
};

Communicator::Slices Communicator::slices_of(Tensor& buffer, const char* op) const {
  check_tensor(buffer, op);
  LT_CHECK(buffer.numel() % size_ == 0, "[comm] ", op, ": the buffer's ", buffer.numel(),
           " elements do not split into ", size_, " equal slices");
  buffer.storage().version++;
  const size_t count = size_t(buffer.numel() / size_), bytes = dtype_size(buffer.dtype());
  char* base = static_cast<char*>(buffer.data());
  return {count, bytes, base, base + size_t(rank_) * count * bytes};
}

void Communicator::reduce_scatter_sum_in_place(Tensor& buffer) {
  [[maybe_unused]] const Slices sl = slices_of(buffer, "reduce_scatter");
  if (!distributed()) return;
#if LINTAPE_WITH_NCCL
  if (buffer.is_cuda()) {
    Nccl* c = nccl_for(buffer);
    cudaStream_t s = cuda::stream(buffer.device().index);
    LT_NCCL_CHECK(ncclReduceScatter(sl.base, sl.mine, sl.count, nccl_type(buffer), ncclSum, c->comm, s));
    return nccl_wait(c->comm, s, "reduce_scatter", rank_);
  }
#endif
#if LINTAPE_WITH_MPI
  // MPI's in-place form leaves the result at the buffer's start: move it to this rank's slice.
  require_host(buffer, "reduce_scatter");
  with_watchdog("reduce_scatter", rank_, [&] {
    LT_MPI_CHECK(MPI_Reduce_scatter_block(MPI_IN_PLACE, sl.base, int(sl.count), mpi_type(buffer, "reduce_scatter"),
                                          MPI_SUM, MPI_COMM_WORLD));
  });
  if (sl.mine != sl.base) std::memmove(sl.mine, sl.base, sl.count * sl.bytes);
#endif
}

void Communicator::all_gather_in_place(Tensor& buffer) {
  [[maybe_unused]] const Slices sl = slices_of(buffer, "all_gather");
  if (!distributed()) return;
#if LINTAPE_WITH_NCCL
  if (buffer.is_cuda()) {
    Nccl* c = nccl_for(buffer);
    cudaStream_t s = cuda::stream(buffer.device().index);
    LT_NCCL_CHECK(ncclAllGather(sl.mine, sl.base, sl.count, nccl_type(buffer), c->comm, s));
    return nccl_wait(c->comm, s, "all_gather", rank_);
  }
#endif
#if LINTAPE_WITH_MPI
  require_host(buffer, "all_gather");
  with_watchdog("all_gather", rank_, [&] {
    LT_MPI_CHECK(MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, sl.base, int(sl.count),
                               mpi_type(buffer, "all_gather"), MPI_COMM_WORLD));
  });
#endif
}

double Communicator::all_reduce_sum(double value) {
#if LINTAPE_WITH_MPI
  if (distributed())
    with_watchdog("all_reduce", rank_, [&] {
      LT_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &value, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD));
    });
#endif
  return value;
}

double Communicator::all_reduce_max(double value) {
#if LINTAPE_WITH_MPI
  if (distributed())
    with_watchdog("all_reduce", rank_, [&] {
      LT_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &value, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD));
    });
#endif
  return value;
}

void Communicator::barrier() {
#if LINTAPE_WITH_MPI
  if (distributed()) with_watchdog("barrier", rank_, [&] { LT_MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD)); });
#endif
}

void Communicator::check_same(const std::string& what, const std::string& value) {
  if (!distributed()) return;
#if LINTAPE_WITH_MPI
  std::string first = value;
  int length = int(first.size());
  with_watchdog("check_same", rank_, [&] {
    LT_MPI_CHECK(MPI_Bcast(&length, 1, MPI_INT, 0, MPI_COMM_WORLD));
    first.resize(size_t(length));
    LT_MPI_CHECK(MPI_Bcast(first.data(), length, MPI_CHAR, 0, MPI_COMM_WORLD));
  });
  const double differs = all_reduce_max(first == value ? 0.0 : 1.0);
  if (differs > 0)
    fail(str("[comm] the ranks disagree on ", what, first == value ? " (another rank differs from rank 0)" : "",
             first == value ? "" : str(": rank ", rank_, " has ", value, ", rank 0 has ", first)));
#else
  (void)what;
  (void)value;
#endif
}

void Communicator::abort(int code) {
#if LINTAPE_WITH_MPI
  if (distributed()) MPI_Abort(MPI_COMM_WORLD, code);
#endif
  std::exit(code);
}

}  // namespace lintape
