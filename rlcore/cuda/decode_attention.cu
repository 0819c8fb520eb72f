// Flash-decoding: attention of one query token per row against the rollout's static KV cache.
//
// PyTorch twin (the CPU path, the test oracle, and the thing to read first):
//   decode_attention  <->  rlcore/rollout/attention.py: decode_attention_twin
//
// q [B, Hq, D] (contiguous); k and v [B, Hkv, slots, D], one layer of the cache (rows, heads and slots
// strided, D contiguous); row b attends over its slots start[b] <= s < end[b], and query head h
// reads kv head h / (Hq / Hkv) (grouped-query attention). Out [B, Hq, D]; fp32 or bf16 in and out,
// fp32 arithmetic. Slots outside a row's range are never read, so a static cache costs what its
// filled part costs.
//
// Pass 1, split_kernel: grid (B * Hkv * head_groups, splits). A block takes one row, one kv head,
// up to kGroup query heads of its group and one split of the slots. Each warp walks every
// kWarps-th key of the split; the 32 lanes read a key's D elements side by side (coalesced) and
// sum the dot product with shuffles. Per query head the warp keeps an online softmax
// (Milakov and Gimelshein, 2018):  m = max score,  l = sum exp(score - m),  acc = sum exp(score - m) v.
// A key and value are read once for all the heads that share them. The warps merge in shared
// memory and the block writes its split's (m, l, acc).
// Pass 2, combine_kernel: one block per (row, query head) merges the splits:
//   M = max m_s,  L = sum l_s exp(m_s - M),  out = sum acc_s exp(m_s - M) / L.
// The splits spread one row's keys over many SMs where the batch alone would leave most idle.
//
// No torch headers: the file builds in seconds, and rlcore/cuda/decode_attention.py calls the
// extern "C" launcher below through ctypes with the tensors' pointers and torch's current stream
// (so a CUDA graph being captured on that stream records the launches).

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>

namespace {

constexpr int kWarps = 4;   // warps per block of pass 1
constexpr int kGroup = 8;   // query heads per block of pass 1 (Qwen2.5-0.5B has 7 per kv head)

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void store(float* p, float x) { *p = x; }
__device__ __forceinline__ void store(__nv_bfloat16* p, float x) { *p = __float2bfloat16(x); }

__device__ __forceinline__ float warp_sum(float x) {
    for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

struct Shape {
    int B, Hq, Hkv, slots, D;
    int64_t row_stride, head_stride, slot_stride;  // of k and v, in elements
    int splits, split_len, head_groups;
    float scale;
};

// EPL: elements of a head vector per lane (D <= 32 * EPL).
template <typename T, int EPL>
__global__ void split_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                             const int64_t* __restrict__ start, const int64_t* __restrict__ end,
                             float* __restrict__ part_m, float* __restrict__ part_l, float* __restrict__ part_acc,
                             Shape sh) {
    const int split = blockIdx.y;  // gridDim.y (at most 65535) is the small one
    const int head_group = blockIdx.x % sh.head_groups;
    const int kv = (blockIdx.x / sh.head_groups) % sh.Hkv;
    const int b = blockIdx.x / (sh.head_groups * sh.Hkv);
    const int group = sh.Hq / sh.Hkv;
    const int h0 = kv * group + head_group * kGroup;              // first query head of this block
    const int heads = min(kGroup, group - head_group * kGroup);   // query heads of this block
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    float qr[kGroup][EPL], acc[kGroup][EPL], m[kGroup], l[kGroup];
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.f;
#pragma unroll
        for (int e = 0; e < EPL; ++e) {
            const int d = lane + 32 * e;
            qr[g][e] = (g < heads && d < sh.D) ? to_float(q[((int64_t)b * sh.Hq + h0 + g) * sh.D + d]) * sh.scale : 0.f;
            acc[g][e] = 0.f;
        }
    }

    const int64_t base = b * sh.row_stride + kv * sh.head_stride;
    const int64_t lo = max(start[b], (int64_t)split * sh.split_len);
    const int64_t hi = min(end[b], (int64_t)(split + 1) * sh.split_len);
    for (int64_t s = lo + warp; s < hi; s += kWarps) {
        float kr[EPL], vr[EPL];
#pragma unroll
        for (int e = 0; e < EPL; ++e) {
            const int d = lane + 32 * e;
            kr[e] = d < sh.D ? to_float(k[base + s * sh.slot_stride + d]) : 0.f;
            vr[e] = d < sh.D ? to_float(v[base + s * sh.slot_stride + d]) : 0.f;
        }
#pragma unroll
        for (int g = 0; g < kGroup; ++g) {
            if (g >= heads) continue;  // the same for every lane: the shuffles stay warp-uniform
            float dot = 0.f;
#pragma unroll
            for (int e = 0; e < EPL; ++e) dot += qr[g][e] * kr[e];
            const float score = warp_sum(dot);
            const float m_new = fmaxf(m[g], score);
            const float rescale = expf(m[g] - m_new);  // 0 for the first key (m = -inf)
            const float p = expf(score - m_new);
            l[g] = l[g] * rescale + p;
#pragma unroll
            for (int e = 0; e < EPL; ++e) acc[g][e] = acc[g][e] * rescale + p * vr[e];
            m[g] = m_new;
        }
    }

    __shared__ float sm_m[kWarps][kGroup], sm_l[kWarps][kGroup];
    __shared__ float sm_acc[kWarps][kGroup][32 * EPL];
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
        if (lane == 0) {
            sm_m[warp][g] = m[g];
            sm_l[warp][g] = l[g];
        }
#pragma unroll
        for (int e = 0; e < EPL; ++e) sm_acc[warp][g][lane + 32 * e] = acc[g][e];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < heads * sh.D; i += blockDim.x) {
        const int g = i / sh.D, d = i % sh.D;
        float top = -INFINITY;
        for (int w = 0; w < kWarps; ++w) top = fmaxf(top, sm_m[w][g]);
        float sum = 0.f, out = 0.f;
        if (top > -INFINITY) {  // else no key of this split is in the row's range
            for (int w = 0; w < kWarps; ++w) {
                const float c = expf(sm_m[w][g] - top);
                sum += sm_l[w][g] * c;
                out += sm_acc[w][g][d] * c;
            }
        }
        const int64_t at = ((int64_t)b * sh.Hq + h0 + g) * sh.splits + split;
        part_acc[at * sh.D + d] = out;
        if (d == 0) {
            part_m[at] = top;
            part_l[at] = sum;
        }
    }
}

template <typename T>
__global__ void combine_kernel(const float* __restrict__ part_m, const float* __restrict__ part_l,
                               const float* __restrict__ part_acc, T* __restrict__ out, Shape sh) {
    const int64_t row_head = blockIdx.x;  // b * Hq + h
    const float* m = part_m + row_head * sh.splits;
    const float* l = part_l + row_head * sh.splits;
    float top = -INFINITY;
    for (int s = 0; s < sh.splits; ++s) top = fmaxf(top, m[s]);
    for (int d = threadIdx.x; d < sh.D; d += blockDim.x) {
        float sum = 0.f, acc = 0.f;
        if (top > -INFINITY) {
            for (int s = 0; s < sh.splits; ++s) {
                const float c = expf(m[s] - top);  // 0 for an empty split (m = -inf)
                sum += l[s] * c;
                acc += part_acc[(row_head * sh.splits + s) * sh.D + d] * c;
            }
        }
        store(out + row_head * sh.D + d, sum > 0.f ? acc / sum : 0.f);  // a row with no slot: zeros
    }
}

template <typename T, int EPL>
void launch(const void* q, const void* k, const void* v, void* out, const int64_t* start, const int64_t* end,
            float* workspace, const Shape& sh, cudaStream_t stream) {
    float* part_m = workspace;
    float* part_l = part_m + (int64_t)sh.B * sh.Hq * sh.splits;
    float* part_acc = part_l + (int64_t)sh.B * sh.Hq * sh.splits;
    const dim3 grid(sh.B * sh.Hkv * sh.head_groups, sh.splits);
    split_kernel<T, EPL><<<grid, kWarps * 32, 0, stream>>>(
        static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), start, end,
        part_m, part_l, part_acc, sh);
    const int threads = sh.D < 32 ? 32 : (sh.D > 256 ? 256 : sh.D);
    combine_kernel<T><<<sh.B * sh.Hq, threads, 0, stream>>>(part_m, part_l, part_acc, static_cast<T*>(out), sh);
}

template <typename T>
void dispatch(const void* q, const void* k, const void* v, void* out, const int64_t* start, const int64_t* end,
              float* workspace, const Shape& sh, cudaStream_t stream) {
    if (sh.D <= 32) launch<T, 1>(q, k, v, out, start, end, workspace, sh, stream);
    else if (sh.D <= 64) launch<T, 2>(q, k, v, out, start, end, workspace, sh, stream);
    else if (sh.D <= 128) launch<T, 4>(q, k, v, out, start, end, workspace, sh, stream);
    else launch<T, 8>(q, k, v, out, start, end, workspace, sh, stream);
}

}  // namespace

extern "C" {

// The number of query heads pass 1 gives one block (the Python side sizes the grid with it).
int rlcore_decode_attention_group() { return kGroup; }

// Launches both passes on `stream`; returns a cudaError_t (0 = launched), or -1 for an argument
// the kernel does not take (the Python side checks them first and says which).
// dtype: 0 = fp32, 1 = bf16. workspace: B * Hq * splits * (D + 2) floats.
int rlcore_decode_attention(int dtype, const void* q, const void* k, const void* v, void* out,
                            const int64_t* start, const int64_t* end, float* workspace,
                            int B, int Hq, int Hkv, int slots, int D,
                            int64_t row_stride, int64_t head_stride, int64_t slot_stride,
                            int splits, float scale, void* stream) {
    if (B < 1 || Hkv < 1 || Hq % Hkv != 0 || D < 1 || D > 256 || splits < 1 || (dtype != 0 && dtype != 1)) return -1;
    const int group = Hq / Hkv;
    Shape sh{B, Hq, Hkv, slots, D, row_stride, head_stride, slot_stride, splits, (slots + splits - 1) / splits,
             (group + kGroup - 1) / kGroup, scale};
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (dtype == 0) dispatch<float>(q, k, v, out, start, end, workspace, sh, s);
    else dispatch<__nv_bfloat16>(q, k, v, out, start, end, workspace, sh, s);
    return static_cast<int>(cudaGetLastError());
}

const char* rlcore_cuda_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // extern "C"
