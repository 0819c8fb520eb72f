// Fused softmax statistics and logit gradients of per-token log-probabilities, one chunk of rows
// at a time. The [C, V] logits come from cuBLAS (h @ W.T); these kernels replace the passes over
// them that follow.
//
// PyTorch twins (the CPU path, the test oracle, and the thing to read first):
//   softmax_stats  <->  rlcore/losses/logprobs.py: chunk_stats
//   logit_grad_    <->  rlcore/losses/logprobs.py: chunk_grad_
//
// softmax_stats reads each row once, and once more to write the softmax when asked (the twin makes
// about eight passes: max, subtract, exp, sum, gather, multiply, sum, divide). It keeps three
// running values per thread, in the manner of the online softmax (Milakov and Gimelshein, 2018):
//   m = max z seen,  s = sum exp(z - m),  t = sum exp(z - m) * (z - m),
// so that  lse = m + log s,  logp = z[target] - lse,  entropy = log s - t / s
// (H = -sum q log q with q = exp(z - m) / s and log q = z - m - log s). t is kept relative to the
// running max so the entropy does not cancel two numbers of the logits' size.
//
// logit_grad_ overwrites the logits with d loss / d logits in one pass:
//   grad_z = g * onehot(target) - q * (g + g_H * (log q + H)),   log q = z - lse
// (g_H absent: grad_z = g * onehot(target) - q * g), in the twin's order of operations.

#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

namespace {

constexpr int kThreads = 512;  // per row; a 152k vocabulary is ~300 elements per thread

__device__ __forceinline__ float exp_of(float x) { return expf(x); }
__device__ __forceinline__ double exp_of(double x) { return ::exp(x); }
__device__ __forceinline__ float log_of(float x) { return logf(x); }
__device__ __forceinline__ double log_of(double x) { return ::log(x); }

template <typename T>
struct Running {
    T m, s, t;  // max, sum exp(z - m), sum exp(z - m) * (z - m); s == 0 means "nothing seen"
};

template <typename T>
__device__ __forceinline__ void add_one(Running<T>& r, T z) {
    if (r.s == T(0)) {  // first element (also keeps -inf - -inf out of the arithmetic)
        r.m = z;
        r.s = T(1);
        r.t = T(0);
    } else if (z > r.m) {  // a new max: rescale what was summed so far, z contributes exp(0) * 0
        const T d = r.m - z;  // < 0
        const T e = exp_of(d);
        r.t = e * (r.t + d * r.s);
        r.s = e * r.s + T(1);
        r.m = z;
    } else {
        const T d = z - r.m;
        const T e = exp_of(d);
        r.s += e;
        r.t += e * d;
    }
}

template <typename T>
__device__ __forceinline__ Running<T> combine(const Running<T>& a, const Running<T>& b) {
    if (a.s == T(0)) return b;
    if (b.s == T(0)) return a;
    const T m = a.m > b.m ? a.m : b.m;
    const T da = a.m - m, db = b.m - m;
    const T ea = exp_of(da), eb = exp_of(db);
    return {m, ea * a.s + eb * b.s, ea * (a.t + da * a.s) + eb * (b.t + db * b.s)};
}

template <typename T>
__device__ __forceinline__ Running<T> warp_combine(Running<T> r) {
    for (int offset = 16; offset > 0; offset /= 2) {
        Running<T> o{__shfl_down_sync(0xffffffff, r.m, offset), __shfl_down_sync(0xffffffff, r.s, offset),
                     __shfl_down_sync(0xffffffff, r.t, offset)};
        r = combine(r, o);
    }
    return r;
}

// One block per row: logits z[row, :] -> lse[row], logp[row], entropy[row]; with write_probs the
// row is then overwritten with its softmax (kept for a backward without recompute).
template <typename T>
__global__ void softmax_stats_kernel(T* __restrict__ z, const int64_t* __restrict__ targets, T* __restrict__ lse,
                                     T* __restrict__ logp, T* __restrict__ entropy, int64_t vocab,
                                     bool write_probs) {
    const int64_t row = blockIdx.x;
    T* zr = z + row * vocab;
    Running<T> r{T(0), T(0), T(0)};
    for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) add_one(r, zr[j]);
    r = warp_combine(r);

    __shared__ Running<T> per_warp[kThreads / 32];
    __shared__ T row_max, row_log_s;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) per_warp[warp] = r;
    __syncthreads();
    if (warp == 0) {
        r = lane < blockDim.x / 32 ? per_warp[lane] : Running<T>{T(0), T(0), T(0)};
        r = warp_combine(r);
        if (lane == 0) {
            const T log_s = log_of(r.s);
            lse[row] = r.m + log_s;
            const int64_t target = targets[row];
            CUDA_KERNEL_ASSERT(target >= 0 && target < vocab);
            logp[row] = (zr[target] - r.m) - log_s;
            entropy[row] = log_s - r.t / r.s;
            row_max = r.m;
            row_log_s = log_s;
        }
    }
    if (!write_probs) return;
    __syncthreads();
    const T m = row_max, log_s = row_log_s;  // (z - m) - log s: no cancellation against a large lse
    for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) zr[j] = exp_of((zr[j] - m) - log_s);
}

// Grid (ceil(V / threads), min(C, 65535)): each thread turns one logit of a row into its
// gradient, in place, for rows blockIdx.y, blockIdx.y + gridDim.y, ...
template <typename T>
__global__ void logit_grad_kernel(T* __restrict__ z, const int64_t* __restrict__ targets,
                                  const T* __restrict__ lse, const T* __restrict__ entropy,
                                  const T* __restrict__ g, const T* __restrict__ g_h, int64_t rows,
                                  int64_t vocab) {
    const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (j >= vocab) return;
    for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
        const T gr = g[row];
        const T log_q = z[row * vocab + j] - lse[row];
        const T q = exp_of(log_q);
        T grad = g_h == nullptr ? q * -gr : -(((log_q + entropy[row]) * g_h[row] + gr) * q);
        if (j == targets[row]) grad += gr;
        z[row * vocab + j] = grad;
    }
}

void check_rows(const torch::Tensor& z, const torch::Tensor& targets, const char* name) {
    TORCH_CHECK(z.is_cuda() && z.dim() == 2 && z.is_contiguous(), name,
                ": logits must be a contiguous [C, V] CUDA tensor");
    TORCH_CHECK(z.scalar_type() == torch::kFloat || z.scalar_type() == torch::kDouble,
                name, ": logits must be float32 or float64, got ", z.scalar_type());
    TORCH_CHECK(targets.device() == z.device() && targets.scalar_type() == torch::kLong && targets.dim() == 1 &&
                targets.size(0) == z.size(0) && targets.is_contiguous(),
                name, ": targets must be a contiguous int64 [C] tensor on the logits' device");
}

void check_vector(const torch::Tensor& v, const torch::Tensor& z, const char* what) {
    TORCH_CHECK(v.device() == z.device() && v.scalar_type() == z.scalar_type() && v.dim() == 1 &&
                v.size(0) == z.size(0) && v.is_contiguous(),
                "logit_grad_: ", what, " must be a contiguous [C] tensor of the logits' dtype and device");
}

}  // namespace

std::vector<torch::Tensor> softmax_stats(torch::Tensor z, torch::Tensor targets, bool write_probs) {
    check_rows(z, targets, "softmax_stats");
    const c10::cuda::CUDAGuard guard(z.device());
    const int64_t rows = z.size(0), vocab = z.size(1);
    auto lse = torch::empty({rows}, z.options()), logp = torch::empty_like(lse), entropy = torch::empty_like(lse);
    if (rows == 0) return {lse, logp, entropy};
    TORCH_CHECK(vocab > 0, "softmax_stats: the vocabulary is empty");
    AT_DISPATCH_FLOATING_TYPES(z.scalar_type(), "softmax_stats", [&] {
        softmax_stats_kernel<scalar_t><<<rows, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
            z.data_ptr<scalar_t>(), targets.data_ptr<int64_t>(), lse.data_ptr<scalar_t>(),
            logp.data_ptr<scalar_t>(), entropy.data_ptr<scalar_t>(), vocab, write_probs);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return {lse, logp, entropy};
}

torch::Tensor logit_grad_(torch::Tensor z, torch::Tensor targets, torch::Tensor lse, torch::Tensor entropy,
                          torch::Tensor g, c10::optional<torch::Tensor> g_h) {
    check_rows(z, targets, "logit_grad_");
    check_vector(lse, z, "lse");
    check_vector(entropy, z, "entropy");
    check_vector(g, z, "g");
    if (g_h) check_vector(*g_h, z, "g_h");
    const c10::cuda::CUDAGuard guard(z.device());
    const int64_t rows = z.size(0), vocab = z.size(1);
    if (rows == 0 || vocab == 0) return z;
    constexpr int threads = 256;
    const dim3 grid(static_cast<unsigned>((vocab + threads - 1) / threads),
                    static_cast<unsigned>(std::min<int64_t>(rows, 65535)));
    AT_DISPATCH_FLOATING_TYPES(z.scalar_type(), "logit_grad_", [&] {
        logit_grad_kernel<scalar_t><<<grid, threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
            z.data_ptr<scalar_t>(), targets.data_ptr<int64_t>(), lse.data_ptr<scalar_t>(),
            entropy.data_ptr<scalar_t>(), g.data_ptr<scalar_t>(),
            g_h ? g_h->data_ptr<scalar_t>() : nullptr, rows, vocab);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return z;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("softmax_stats", &softmax_stats, "[C, V] logits -> (lse, logp, entropy) [C]; optionally the softmax in place",
          py::arg("z"), py::arg("targets"), py::arg("write_probs"));
    m.def("logit_grad_", &logit_grad_, "[C, V] logits -> d loss / d logits, in place",
          py::arg("z"), py::arg("targets"), py::arg("lse"), py::arg("entropy"), py::arg("g"), py::arg("g_h"));
}
