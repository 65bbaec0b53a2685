// raggedspec's hand-written kernels (issue 5): the hot tensor-side rules, one launch each.
//
// One source, two builds:
//   - NVRTC through CuPy (gpu/cupy_kernels.py), on a CUDA GPU;
//   - g++ under gpu/kernel_emulator.py's prelude (RS_EMULATE), on the CPU: every block runs as
//     real threads with a real barrier, so the index arithmetic, the masks and the online
//     softmax are tested against the reference without a GPU. Hence the CUDA subset used
//     here: blockIdx / threadIdx / blockDim / gridDim, __shared__ arrays, __syncthreads(),
//     no warp intrinsics, no atomics.
//
// Compile-time parameters, prepended by the loader as #defines:
//   RS_ELEM  storage type of K/V/Q/x/masks: float | double | rs_bf16 (bf16 bits in a ushort)
//   RS_ACC   compute type: double for float64 storage, float otherwise
//   RS_NQ    rs_verify_attention_*: queries per (row, KV head) = G * w
//   RS_D     rs_verify_attention_*: head dim
//   RS_NT    rs_verify_attention_partial: threads per block = keys per tile
//
// Layouts (row-major, contiguous):
//   KV in place (gpu.cache.RaggedKv): [B, Hk, cap, D], row b's position p at column p, live iff
//   p < lens[b]; columns past lens[b] are slack and are never read by the attention kernel.

#ifndef RS_EMULATE
#define RS_DEV __device__ __forceinline__
#endif

typedef unsigned short rs_bf16;

RS_DEV float rs_bits_float(unsigned u) { return __uint_as_float(u); }
RS_DEV rs_bf16 rs_float_bf16(float f) {  // round to nearest even (finite values)
    unsigned u = __float_as_uint(f);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (rs_bf16)(u >> 16);
}
RS_DEV RS_ACC rs_load(float x) { return (RS_ACC)x; }
RS_DEV RS_ACC rs_load(double x) { return (RS_ACC)x; }
RS_DEV RS_ACC rs_load(rs_bf16 x) { return (RS_ACC)rs_bits_float(((unsigned)x) << 16); }
RS_DEV void rs_store(float* p, RS_ACC a) { *p = (float)a; }
RS_DEV void rs_store(double* p, RS_ACC a) { *p = (double)a; }
RS_DEV void rs_store(rs_bf16* p, RS_ACC a) { *p = rs_float_bf16((float)a); }
RS_DEV float rs_exp(float x) { return expf(x); }
RS_DEV double rs_exp(double x) { return exp(x); }
RS_DEV RS_ACC rs_neg_inf() { return (RS_ACC)__int_as_float(0xff800000); }


// Front-alignment of every row in one launch (gpu.align.materialize_front_aligned):
// out[b, h, j] = buf[b, h, j - (T - lens[b])] where that column is >= 0, else 0. K and V
// together; one thread per output element (grid-stride).
extern "C" __global__ void rs_front_align(const RS_ELEM* k, const RS_ELEM* v, const long long* lens,
                                          RS_ELEM* k_out, RS_ELEM* v_out, long long B, long long H,
                                          long long C, long long T, long long D) {
    long long n = B * H * T * D;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        long long d = i % D, j = (i / D) % T, bh = i / (D * T), b = bh / H;
        long long src = j - (T - lens[b]);
        if (src >= 0) {
            long long s = (bh * C + src) * D + d;
            k_out[i] = k[s];
            v_out[i] = v[s];
        } else {
            k_out[i] = (RS_ELEM)0;
            v_out[i] = (RS_ELEM)0;
        }
    }
}


// Dead-prefix strip of every row in one launch (gpu.align.strip_dead_prefix): a front-aligned
// batch [B, H, W, D] with row b's live run at [leads[b], W) back to the in-place layout:
// out[b, h, j] = front[b, h, j + leads[b]] while that is < W, else 0.
extern "C" __global__ void rs_strip_dead_prefix(const RS_ELEM* k, const RS_ELEM* v, const long long* leads,
                                                RS_ELEM* k_out, RS_ELEM* v_out, long long B, long long H,
                                                long long W, long long D) {
    long long n = B * H * W * D;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        long long d = i % D, j = (i / D) % W, bh = i / (D * W), b = bh / H;
        long long src = j + leads[b];
        if (src < W) {
            long long s = (bh * W + src) * D + d;
            k_out[i] = k[s];
            v_out[i] = v[s];
        } else {
            k_out[i] = (RS_ELEM)0;
            v_out[i] = (RS_ELEM)0;
        }
    }
}


// Ragged union mask (reference.masks.ragged_union_mask), additive [B, t_q, t_k + t_c]:
// query r of row b sits at qp = q0 + r; raw column c is key kp = raw_base + c, valid iff
// kp <= qp, kp > qp - window and kp >= lead_b = q0 - rows[b] (the row's dead prefix);
// compressed column blk valid iff blk < (rows[b] + r + 1) / ratio (the row's own position).
extern "C" __global__ void rs_ragged_union_mask(const long long* rows, long long B, long long t_q,
                                                long long q0, long long raw_base, long long t_k,
                                                long long t_c, long long ratio, long long window,
                                                RS_ELEM* out) {
    long long width = t_k + t_c, n = B * t_q * width;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        long long col = i % width, r = (i / width) % t_q, b = i / (width * t_q);
        long long qp = q0 + r;
        bool ok;
        if (col < t_k) {
            long long kp = raw_base + col;
            ok = kp <= qp && kp > qp - window && kp >= q0 - rows[b];
        } else {
            ok = (col - t_k) < (rows[b] + r + 1) / ratio;
        }
        rs_store(out + i, ok ? (RS_ACC)0 : rs_neg_inf());
    }
}


// Per-row RoPE (gpu.rope.apply_rope): x [B, H, T, D]; token t of row b at position
// offsets[n_off == 1 ? 0 : b] + t; the last rope_dims dims rotate as interleaved pairs by
// angle pos * theta^(-2k / rope_dims) (computed in double, as the reference does), the rest
// are copied. inverse != 0 rotates backwards.
extern "C" __global__ void rs_rope(const RS_ELEM* x, const long long* offsets, long long n_off,
                                   long long B, long long H, long long T, long long D,
                                   long long rope_dims, double theta, int inverse, RS_ELEM* out) {
    long long n = B * H * T * D, lo = D - rope_dims;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        long long d = i % D, t = (i / D) % T, b = i / (D * T * H);
        if (d < lo) {
            out[i] = x[i];
            continue;
        }
        long long pair = (d - lo) / 2, odd = (d - lo) % 2;
        double pos = (double)(offsets[n_off == 1 ? 0 : b] + t);
        double ang = pos * pow(theta, -(2.0 * (double)pair) / (double)rope_dims);
        RS_ACC c = (RS_ACC)cos(ang), s = (RS_ACC)sin(ang);
        if (inverse) s = -s;
        RS_ACC e = rs_load(x[i - odd]), o = rs_load(x[i - odd + 1]);
        rs_store(out + i, odd ? e * s + o * c : e * c - o * s);
    }
}


// Ragged verify attention in place (DSV4 rules), split over the key axis (flash-decoding).
// Part 1. Grid (n_split, Hk, B); block RS_NT threads. Query row b reads KV row rows[b]
// (n = lens[rows[b]] live positions); block (s, hk, b) owns its RS_NQ = G * w queries of KV
// head hk (query heads hk*G .. hk*G+G-1, each w rows: contiguous in q). Query r (qi % w) sits
// at qp = n - w + r. Its keys, as one virtual run cut per row:
//   raw:        p in [max(0, n - w + 1 - window), n), valid iff qp - window < p <= qp
//               (only the live keys some query of the window can see: never past n, never
//               before the window);
//   compressed: block c in [0, min(t_c, n / ratio)) of ck (start-anchored, K == V), valid iff
//               c < (qp + 1) / ratio (the block is complete at or before the query).
// The run is split in n_split chunks (rounded to tiles); per tile of RS_NT keys: (1) thread t
// scores key t against every query (q pre-scaled in shared memory); (2) thread qi folds the
// tile into its running max / sum (online softmax); (3) thread t accumulates head-dim columns
// t, t + RS_NT, ... of P V (V rows read coalesced). Writes per query the split's max, sum and
// unnormalized accumulator; part 2 combines the splits (and the sinks).
#define RS_DPT ((RS_D + RS_NT - 1) / RS_NT)
extern "C" __global__ void rs_verify_attention_partial(const RS_ELEM* q, const RS_ELEM* k, const RS_ELEM* v,
                                                       const long long* lens, const long long* rows,
                                                       const RS_ELEM* ck, long long t_c, long long ratio,
                                                       long long B, long long Hk, long long cap, long long w,
                                                       long long window, long long n_split, double scale,
                                                       RS_ACC* part_m, RS_ACC* part_l, RS_ACC* part_acc) {
    __shared__ RS_ACC q_s[RS_NQ * RS_D];
    __shared__ RS_ACC p_s[RS_NQ * RS_NT];
    __shared__ RS_ACC m_s[RS_NQ];
    __shared__ RS_ACC l_s[RS_NQ];
    __shared__ RS_ACC alpha_s[RS_NQ];
    const long long tid = threadIdx.x, s = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    const long long row = rows[b], n = lens[row];
    const long long kstart = (n - w + 1 - window > 0) ? n - w + 1 - window : 0;
    const long long n_raw = n - kstart;
    long long n_comp = 0;
    if (t_c > 0) n_comp = (n / ratio < t_c) ? n / ratio : t_c;
    const long long nk = n_raw + n_comp;
    long long per = (nk + n_split - 1) / n_split;
    per = (per + RS_NT - 1) / RS_NT * RS_NT;
    const long long kbeg = s * per;
    const long long kend = (kbeg + per < nk) ? kbeg + per : nk;
    const long long qbase = (b * Hk + hk) * RS_NQ * RS_D;   // H * w * D per row, G * w * D per KV head
    const long long kvbase = (row * Hk + hk) * cap * RS_D;
    const long long ckbase = (row * Hk + hk) * t_c * RS_D;
    for (long long i = tid; i < RS_NQ * RS_D; i += RS_NT) q_s[i] = rs_load(q[qbase + i]) * (RS_ACC)scale;
    for (long long qi = tid; qi < RS_NQ; qi += RS_NT) {
        m_s[qi] = rs_neg_inf();
        l_s[qi] = (RS_ACC)0;
    }
    RS_ACC acc[RS_NQ][RS_DPT];
    for (int qi = 0; qi < RS_NQ; ++qi)
        for (int j = 0; j < RS_DPT; ++j) acc[qi][j] = (RS_ACC)0;
    __syncthreads();
    for (long long t0 = kbeg; t0 < kend; t0 += RS_NT) {
        const long long j = t0 + tid;
        if (j < kend) {                                                   // (1) scores
            const bool raw = j < n_raw;
            const long long p = raw ? kstart + j : j - n_raw;             // position, or block
            const RS_ELEM* kr = raw ? k + kvbase + p * RS_D : ck + ckbase + p * RS_D;
            RS_ACC dot[RS_NQ];
            for (int qi = 0; qi < RS_NQ; ++qi) dot[qi] = (RS_ACC)0;
            for (int d = 0; d < RS_D; ++d) {
                RS_ACC kd = rs_load(kr[d]);
                for (int qi = 0; qi < RS_NQ; ++qi) dot[qi] += q_s[qi * RS_D + d] * kd;
            }
            for (int qi = 0; qi < RS_NQ; ++qi) {
                const long long qp = n - w + qi % w;
                const bool ok = raw ? (p <= qp && p > qp - window) : (p < (qp + 1) / ratio);
                p_s[qi * RS_NT + tid] = ok ? dot[qi] : rs_neg_inf();
            }
        } else {
            for (int qi = 0; qi < RS_NQ; ++qi) p_s[qi * RS_NT + tid] = rs_neg_inf();
        }
        __syncthreads();
        for (long long qi = tid; qi < RS_NQ; qi += RS_NT) {              // (2) online softmax
            RS_ACC* prow = p_s + qi * RS_NT;
            RS_ACC mx = m_s[qi];
            for (int jj = 0; jj < RS_NT; ++jj) mx = prow[jj] > mx ? prow[jj] : mx;
            if (mx == rs_neg_inf()) {            // nothing visible yet: keep the state as is
                alpha_s[qi] = (RS_ACC)1;
                for (int jj = 0; jj < RS_NT; ++jj) prow[jj] = (RS_ACC)0;
            } else {
                RS_ACC alpha = rs_exp(m_s[qi] - mx), sum = (RS_ACC)0;   // exp(-inf) = 0
                for (int jj = 0; jj < RS_NT; ++jj) {
                    RS_ACC e = rs_exp(prow[jj] - mx);
                    prow[jj] = e;
                    sum += e;
                }
                l_s[qi] = l_s[qi] * alpha + sum;
                m_s[qi] = mx;
                alpha_s[qi] = alpha;
            }
        }
        __syncthreads();
        const long long tile = (kend - t0 < RS_NT) ? kend - t0 : RS_NT;   // (3) P V
        for (int jd = 0; jd < RS_DPT; ++jd) {
            const long long d = tid + (long long)jd * RS_NT;
            if (d >= RS_D) break;
            for (int qi = 0; qi < RS_NQ; ++qi) acc[qi][jd] *= alpha_s[qi];
            for (long long jj = 0; jj < tile; ++jj) {
                const long long jk = t0 + jj;
                const RS_ELEM* vr = jk < n_raw ? v + kvbase + (kstart + jk) * RS_D : ck + ckbase + (jk - n_raw) * RS_D;
                RS_ACC vd = rs_load(vr[d]);
                for (int qi = 0; qi < RS_NQ; ++qi) acc[qi][jd] += p_s[qi * RS_NT + jj] * vd;
            }
        }
        __syncthreads();
    }
    const long long pbase = ((s * B + b) * Hk + hk) * RS_NQ;
    for (long long qi = tid; qi < RS_NQ; qi += RS_NT) {
        part_m[pbase + qi] = m_s[qi];
        part_l[pbase + qi] = l_s[qi];
    }
    for (int jd = 0; jd < RS_DPT; ++jd) {
        const long long d = tid + (long long)jd * RS_NT;
        if (d >= RS_D) break;
        for (int qi = 0; qi < RS_NQ; ++qi) part_acc[(pbase + qi) * RS_D + d] = acc[qi][jd];
    }
}


// Part 2: out[b, hk*G + g, r, d] = sum_s e^(m_s - M) acc_s / (sum_s e^(m_s - M) l_s + e^(sink_h - M))
// over the splits, M = max(max_s m_s, sink_h) (finite: key qp itself is always visible); the
// per-query-head sink joins the denominator only (has_sinks 0: no sink term). One thread per
// output element; out has q's layout, so (b, hk, qi, d) is its flat index.
extern "C" __global__ void rs_verify_attention_combine(const RS_ACC* part_m, const RS_ACC* part_l,
                                                       const RS_ACC* part_acc, const RS_ELEM* sinks,
                                                       int has_sinks, long long B, long long Hk, long long w,
                                                       long long n_split, RS_ELEM* out) {
    const long long n = B * Hk * RS_NQ * RS_D;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long row = i / RS_D;                                  // (b * Hk + hk) * RS_NQ + qi
        const long long stride = B * Hk * RS_NQ;
        const long long head = ((row / RS_NQ) % Hk) * (RS_NQ / w) + (row % RS_NQ) / w;
        RS_ACC mx = rs_neg_inf();
        for (long long s = 0; s < n_split; ++s) mx = part_m[s * stride + row] > mx ? part_m[s * stride + row] : mx;
        RS_ACC sink = has_sinks ? rs_load(sinks[head]) : rs_neg_inf();
        if (has_sinks && sink > mx) mx = sink;
        RS_ACC num = (RS_ACC)0, den = has_sinks ? rs_exp(sink - mx) : (RS_ACC)0;
        for (long long s = 0; s < n_split; ++s) {
            RS_ACC f = rs_exp(part_m[s * stride + row] - mx);
            num += f * part_acc[(s * stride + row) * RS_D + i % RS_D];
            den += f * part_l[s * stride + row];
        }
        rs_store(out + i, num / den);
    }
}
