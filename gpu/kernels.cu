// raggedspec's hand-written kernels: the hot tensor-side rules, one launch each.
//
// One source, two builds:
//   - NVRTC through CuPy (gpu/cupy_kernels.py), on a CUDA GPU;
//   - g++ under gpu/kernel_emulator.py's prelude (RS_EMULATE), on the CPU: every block runs as
//     real threads with a real barrier, so the index arithmetic, the masks and the online
//     softmax are tested against the reference without a GPU. Hence the CUDA subset used
//     here: blockIdx / threadIdx / blockDim / gridDim, __shared__ arrays and dynamic shared
//     memory (RS_DYNAMIC_SMEM), __syncthreads(), __syncwarp(), __shfl_xor_sync, and the
//     tensor-core kernel's primitives (rs_ldmatrix_*, rs_mma_bf16, rs_cp_async*: inline PTX
//     here, the PTX ISA's semantics in the emulator); no atomics.
//
// Compile-time parameters, prepended by the loader as #defines:
//   RS_ELEM  storage type of K/V/Q/x/masks: float | double | rs_bf16 (bf16 bits in a ushort)
//   RS_ACC   compute type: double for float64 storage, float otherwise
//   RS_NQ    rs_verify_attention_*: queries per (row, KV head) = G * w
//   RS_D     rs_verify_attention_*: head dim
//   RS_NT    rs_verify_attention_partial: threads per block = keys per tile
//   RS_WARPS, RS_STAGES  rs_verify_attention_tc: warps per block, cp.async stages
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
// unnormalized accumulator; part 2 combines the splits (and the sinks). A row index outside
// [0, n_kv) or a length outside [w, cap] (values the host did not read) gives NaN partials.
#define RS_DPT ((RS_D + RS_NT - 1) / RS_NT)
extern "C" __global__ void rs_verify_attention_partial(const RS_ELEM* q, const RS_ELEM* k, const RS_ELEM* v,
                                                       const long long* lens, const long long* rows,
                                                       const RS_ELEM* ck, long long t_c, long long ratio,
                                                       long long B, long long Hk, long long cap, long long w,
                                                       long long window, long long n_split, long long n_kv,
                                                       double scale, RS_ACC* part_m, RS_ACC* part_l,
                                                       RS_ACC* part_acc) {
    __shared__ RS_ACC q_s[RS_NQ * RS_D];
    __shared__ RS_ACC p_s[RS_NQ * RS_NT];
    __shared__ RS_ACC m_s[RS_NQ];
    __shared__ RS_ACC l_s[RS_NQ];
    __shared__ RS_ACC alpha_s[RS_NQ];
    const long long tid = threadIdx.x, s = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    const long long row = rows[b], n = (row >= 0 && row < n_kv) ? lens[row] : -1;
    const long long pbase = ((s * B + b) * Hk + hk) * RS_NQ;
    if (n < w || n > cap) {                  // values the host did not read: NaN, never a guess
        for (long long i = tid; i < RS_NQ * RS_D; i += RS_NT) {
            part_acc[pbase * RS_D + i] = (RS_ACC)__int_as_float(0x7fc00000);
            if (i % RS_D == 0) part_m[pbase + i / RS_D] = part_l[pbase + i / RS_D] = (RS_ACC)__int_as_float(0x7fc00000);
        }
        return;
    }
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


// ---------------------------------------------------------------------------------------------
// Tensor-core verify attention (bf16 storage, float accumulation): the same rules and the same
// partial outputs as rs_verify_attention_partial (so rs_verify_attention_combine finishes it),
// on mma.sync.m16n8k16. Compile-time parameters besides RS_NQ / RS_D:
//   RS_WARPS   warps per block (1, 2 or 4); RS_STAGES  cp.async pipeline depth (2..4)
// The primitives below are PTX on the GPU; under RS_EMULATE gpu/kernel_emulator.py's prelude
// defines them with the PTX ISA's semantics (warp lanes, fragment layouts, deferred copies).
#ifndef RS_EMULATE
#define RS_DYNAMIC_SMEM(name) extern __shared__ __align__(128) unsigned char name[]
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
// No bf16 mma.sync / cp.async before sm_80: the host never picks the tensor-core kernel there
// (Kernels.tc_fits), and these stand-ins keep the rest of the module building.
RS_DEV void rs_ldmatrix_x4(unsigned (&r)[4], const void*) { r[0] = r[1] = r[2] = r[3] = 0u; __trap(); }
RS_DEV void rs_ldmatrix_x4_trans(unsigned (&r)[4], const void*) { r[0] = r[1] = r[2] = r[3] = 0u; __trap(); }
RS_DEV void rs_ldmatrix_x2(unsigned (&r)[2], const void*) { r[0] = r[1] = 0u; __trap(); }
RS_DEV void rs_mma_bf16(float (&)[4], const unsigned (&)[4], const unsigned (&)[2]) { __trap(); }
RS_DEV void rs_cp_async16(void*, const void*, unsigned) { __trap(); }
RS_DEV void rs_cp_async_commit() {}
template <int N> RS_DEV void rs_cp_async_wait() {}
#else
RS_DEV unsigned rs_smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
RS_DEV void rs_ldmatrix_x4(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(rs_smem_addr(p)));
}
RS_DEV void rs_ldmatrix_x4_trans(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(rs_smem_addr(p)));
}
RS_DEV void rs_ldmatrix_x2(unsigned (&r)[2], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(rs_smem_addr(p)));
}
RS_DEV void rs_mma_bf16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
RS_DEV void rs_cp_async16(void* dst, const void* src, unsigned src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(rs_smem_addr(dst)), "l"(src), "r"(src_bytes) : "memory");
}
RS_DEV void rs_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> RS_DEV void rs_cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory"); }
#endif
#endif

#ifndef RS_WARPS
#define RS_WARPS 4
#endif
#ifndef RS_STAGES
#define RS_STAGES 3
#endif
#define RS_TC_THREADS (RS_WARPS * 32)
#define RS_TC_MIN_BLOCKS 1                                           // registers: up to 255 a thread
#define RS_TILE 64                                                   // keys per pipeline stage
#define RS_TC_D ((RS_D % 16 == 0 && RS_D >= 16) ? RS_D : 16)         // builds for other kernels
#define RS_TC_NQ (((RS_NQ + 7) / 8) * 8)                             // queries padded to n = 8
#define RS_TC_PITCH 24   // p_s row pitch (bf16): 48-byte rows, 8 ldmatrix rows hit 8 bank groups

// Element offset of (row, col) in a [rows][RS_TC_D] bf16 tile: 16-byte chunk c of row r sits at
// chunk c ^ (r % 8) (fewer rows when the row has fewer than 8 chunks), so the 8 rows one
// ldmatrix reads at one column land in 8 different bank groups.
RS_DEV int rs_swz(int row, int col) {
    constexpr int CH = RS_TC_D / 8, SW = CH < 8 ? CH : 8;
    return row * RS_TC_D + ((((col >> 3) ^ (row & (SW - 1)))) << 3) + (col & 7);
}

// One stage: keys t0 .. t0 + RS_TILE - 1 of the row's virtual run (raw keys from kstart, then
// compressed blocks) into k_s / v_s by 16-byte cp.async; keys at or past kend are zero-filled
// and not read.
RS_DEV void rs_tc_load_tile(rs_bf16* ks, rs_bf16* vs, const rs_bf16* kb, const rs_bf16* vb, const rs_bf16* cb,
                            int t0, int kend, int n_raw, int kstart, int tid) {
    constexpr int CH = RS_TC_D / 8;
    for (int i = tid; i < RS_TILE * CH; i += RS_TC_THREADS) {
        const int r = i / CH, c = i % CH, j = t0 + r;
        const bool live = j < kend, raw = j < n_raw;
        const int off = (raw ? kstart + j : j - n_raw) * RS_TC_D + c * 8;
        rs_cp_async16(ks + rs_swz(r, c * 8), live ? (raw ? kb : cb) + off : kb, live ? 16u : 0u);
        rs_cp_async16(vs + rs_swz(r, c * 8), live ? (raw ? vb : cb) + off : vb, live ? 16u : 0u);
    }
}

// Grid (n_split, Hk, B), RS_WARPS warps. Keys, splits, masks and outputs exactly as in
// rs_verify_attention_partial (part_m in natural-log units). Per stage of RS_TILE keys, warp
// i takes 16-key sub-tiles i, i + RS_WARPS, ...: S^T = K Q^T (m = 16 keys, n = 8 queries,
// k = 16 dims), scaled to log2 units, masked only when the tile is on an edge of the row (the
// window's first keys, the causal last keys, the partial compressed blocks, the split's end),
// an online softmax per query column by shuffles over the 8 lanes sharing it, P^T to shared
// memory as bf16, then O^T += V^T P^T (m = 16 dims, k = 16 keys). Each warp keeps its own
// max / sum / accumulator; the warps combine once, at the end, through shared memory. A row
// index outside [0, n_kv) or a length outside [w, cap] (values the host did not read) makes
// the block write NaN: loud, never a wrong finite answer.
extern "C" __global__ void __launch_bounds__(RS_TC_THREADS, RS_TC_MIN_BLOCKS) rs_verify_attention_tc(const rs_bf16* q, const rs_bf16* k,
        const rs_bf16* v, const long long* lens, const long long* rows, const rs_bf16* ck, int t_c, int ratio, int B,
        int Hk, int cap, int w, int window, int n_split, int n_kv, float scale_log2, float* part_m, float* part_l,
        float* part_acc) {
    constexpr int D = RS_TC_D, NQP = RS_TC_NQ, NT8 = NQP / 8, KS = D / 16, SUBS = RS_TILE / 16;
    constexpr int KV_BYTES = 2 * RS_STAGES * RS_TILE * D * 2, O_BYTES = RS_WARPS * NQP * D * 4;
    const float NEG_INF = __int_as_float(0xff800000);
    RS_DYNAMIC_SMEM(smem);
    rs_bf16* k_s = (rs_bf16*)smem;                                  // [RS_STAGES][RS_TILE][D]
    rs_bf16* v_s = k_s + RS_STAGES * RS_TILE * D;                   // [RS_STAGES][RS_TILE][D]
    rs_bf16* q_s = (rs_bf16*)(smem + (KV_BYTES > O_BYTES ? KV_BYTES : O_BYTES));   // [NQP][D]
    rs_bf16* p_s = q_s + NQP * D;                                   // [RS_WARPS][NQP][RS_TC_PITCH]
    float* m_w = (float*)(p_s + RS_WARPS * NQP * RS_TC_PITCH);      // [RS_WARPS][NQP]
    float* l_w = m_w + RS_WARPS * NQP;                              // [RS_WARPS][NQP]
    float* o_w = (float*)smem;                     // [RS_WARPS][NQP][D], after the loop, over the stages
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
    const int s = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    const size_t pbase = (((size_t)s * B + b) * Hk + hk) * RS_NQ;
    const long long row = rows[b];
    const long long n_ll = (row >= 0 && row < n_kv) ? lens[row] : -1;
    if (n_ll < w || n_ll > cap) {
        const float nan = __int_as_float(0x7fc00000);
        for (int i = tid; i < RS_NQ * D; i += RS_TC_THREADS) {
            part_acc[pbase * D + i] = nan;
            if (i % D == 0) part_m[pbase + i / D] = part_l[pbase + i / D] = nan;
        }
        return;
    }
    const int n = (int)n_ll;
    const int kstart = (n - w + 1 - window > 0) ? n - w + 1 - window : 0;
    const int n_raw = n - kstart;
    const int n_comp = t_c > 0 ? ((n / ratio < t_c) ? n / ratio : t_c) : 0;
    const int nk = n_raw + n_comp;
    int per = (nk + n_split - 1) / n_split;
    per = (per + RS_TILE - 1) / RS_TILE * RS_TILE;
    const int kbeg = (s * per < nk) ? s * per : nk;
    const int kend = (kbeg + per < nk) ? kbeg + per : nk;
    const int full_lo = ((n - window > 0) ? n - window : 0) - kstart;   // raw keys every query sees:
    const int full_hi = n - w + 1 - kstart;                             //   [full_lo, full_hi)
    const int n_full_comp = (n - w + 1) / ratio;                         // blocks every query sees
    const int cfull_hi = n_raw + ((n_comp < n_full_comp) ? n_comp : n_full_comp);
    const size_t kv_off = ((size_t)row * Hk + hk) * (size_t)cap * D;
    const rs_bf16* kb = k + kv_off;
    const rs_bf16* vb = v + kv_off;
    const rs_bf16* cb = t_c > 0 ? ck + ((size_t)row * Hk + hk) * (size_t)t_c * D : kb;
    const rs_bf16* qb = q + ((size_t)b * Hk + hk) * RS_NQ * D;
    const int n_tiles = (kend - kbeg + RS_TILE - 1) / RS_TILE;

    for (int i = tid; i < NQP * (D / 8); i += RS_TC_THREADS) {         // q joins the first group
        const int r = i / (D / 8), c = i % (D / 8);
        rs_cp_async16(q_s + rs_swz(r, c * 8), r < RS_NQ ? qb + r * D + c * 8 : qb, r < RS_NQ ? 16u : 0u);
    }
    for (int i = 0; i < RS_STAGES - 1; ++i) {                           // prologue: one group a stage
        if (i < n_tiles)
            rs_tc_load_tile(k_s + i * RS_TILE * D, v_s + i * RS_TILE * D, kb, vb, cb, kbeg + i * RS_TILE, kend,
                            n_raw, kstart, tid);
        rs_cp_async_commit();
    }
    float o[KS][NT8][4], m[NT8][2], l[NT8][2];
    #pragma unroll
    for (int nt = 0; nt < NT8; ++nt) {
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            m[nt][h] = NEG_INF;
            l[nt][h] = 0.f;
        }
        #pragma unroll
        for (int mt = 0; mt < KS; ++mt)
            #pragma unroll
            for (int i = 0; i < 4; ++i) o[mt][nt][i] = 0.f;
    }
    rs_bf16* pw = p_s + warp * NQP * RS_TC_PITCH;
    for (int it = 0; it < n_tiles; ++it) {
        rs_cp_async_wait<RS_STAGES - 2>();      // this thread's copies of tile `it` have landed
        __syncthreads();                        // everyone's; and stage (it - 1) is free again
        const int nxt = it + RS_STAGES - 1;
        if (nxt < n_tiles)
            rs_tc_load_tile(k_s + (nxt % RS_STAGES) * RS_TILE * D, v_s + (nxt % RS_STAGES) * RS_TILE * D, kb, vb, cb,
                            kbeg + nxt * RS_TILE, kend, n_raw, kstart, tid);
        rs_cp_async_commit();
        const rs_bf16* kt = k_s + (it % RS_STAGES) * RS_TILE * D;
        const rs_bf16* vt = v_s + (it % RS_STAGES) * RS_TILE * D;
        const int t0 = kbeg + it * RS_TILE;
        const bool edge = !(t0 + RS_TILE <= kend && ((t0 >= full_lo && t0 + RS_TILE <= full_hi) ||
                                                     (t0 >= n_raw && t0 + RS_TILE <= cfull_hi)));
        for (int sub = warp; sub < SUBS; sub += RS_WARPS) {
            const int r0 = sub * 16;
            if (t0 + r0 >= kend) break;
            float sc[NT8][4];
            #pragma unroll
            for (int nt = 0; nt < NT8; ++nt)
                #pragma unroll
                for (int i = 0; i < 4; ++i) sc[nt][i] = 0.f;
            #pragma unroll
            for (int ks = 0; ks < KS; ++ks) {                                   // S^T = K Q^T
                unsigned a[4];
                rs_ldmatrix_x4(a, kt + rs_swz(r0 + (lane & 7) + ((lane >> 3) & 1) * 8, (ks * 2 + (lane >> 4)) * 8));
                #pragma unroll
                for (int nt = 0; nt < NT8; ++nt) {
                    unsigned bq[2];
                    rs_ldmatrix_x2(bq, q_s + rs_swz(nt * 8 + (lane & 7), (ks * 2 + ((lane >> 3) & 1)) * 8));
                    rs_mma_bf16(sc[nt], a, bq);
                }
            }
            #pragma unroll
            for (int nt = 0; nt < NT8; ++nt)
                #pragma unroll
                for (int i = 0; i < 4; ++i) {
                    float x = sc[nt][i] * scale_log2;
                    if (edge) {                                                  // the row's edges only
                        const int j = t0 + r0 + g + (i >> 1) * 8, qp = n - w + (nt * 8 + t4 * 2 + (i & 1)) % w;
                        bool ok = j < kend;
                        if (ok && j < n_raw) ok = kstart + j <= qp && kstart + j > qp - window;
                        else if (ok) ok = j - n_raw < (qp + 1) / ratio;
                        x = ok ? x : NEG_INF;
                    }
                    sc[nt][i] = x;
                }
            #pragma unroll
            for (int nt = 0; nt < NT8; ++nt)
                #pragma unroll
                for (int h = 0; h < 2; ++h) {                                    // online softmax
                    float mx = fmaxf(sc[nt][h], sc[nt][h + 2]);
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
                    const float m_new = fmaxf(m[nt][h], mx);
                    const float m_use = m_new == NEG_INF ? 0.f : m_new;        // nothing visible yet
                    const float alpha = exp2f(m[nt][h] - m_use);
                    const float p0 = exp2f(sc[nt][h] - m_use), p1 = exp2f(sc[nt][h + 2] - m_use);
                    l[nt][h] = l[nt][h] * alpha + p0 + p1;
                    m[nt][h] = m_new;
                    #pragma unroll
                    for (int mt = 0; mt < KS; ++mt) {
                        o[mt][nt][h] *= alpha;
                        o[mt][nt][h + 2] *= alpha;
                    }
                    rs_bf16* pr = pw + (nt * 8 + t4 * 2 + h) * RS_TC_PITCH;
                    pr[g] = rs_float_bf16(p0);
                    pr[g + 8] = rs_float_bf16(p1);
                }
            __syncwarp();
            unsigned bp[NT8][2];
            #pragma unroll
            for (int nt = 0; nt < NT8; ++nt)
                rs_ldmatrix_x2(bp[nt], pw + (nt * 8 + (lane & 7)) * RS_TC_PITCH + ((lane >> 3) & 1) * 8);
            #pragma unroll
            for (int mt = 0; mt < KS; ++mt) {                                   // O^T += V^T P^T
                unsigned a[4];
                rs_ldmatrix_x4_trans(a, vt + rs_swz(r0 + (lane & 7) + (lane >> 4) * 8, (mt * 2 + ((lane >> 3) & 1)) * 8));
                #pragma unroll
                for (int nt = 0; nt < NT8; ++nt) rs_mma_bf16(o[mt][nt], a, bp[nt]);
            }
            __syncwarp();
        }
    }
    rs_cp_async_wait<0>();
    #pragma unroll
    for (int nt = 0; nt < NT8; ++nt)
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            l[nt][h] += __shfl_xor_sync(0xffffffffu, l[nt][h], 4);
            l[nt][h] += __shfl_xor_sync(0xffffffffu, l[nt][h], 8);
            l[nt][h] += __shfl_xor_sync(0xffffffffu, l[nt][h], 16);
        }
    __syncthreads();                            // every warp is done with the stages: o_w reuses them
    #pragma unroll
    for (int nt = 0; nt < NT8; ++nt) {
        if (g == 0)
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                m_w[warp * NQP + nt * 8 + t4 * 2 + h] = m[nt][h];
                l_w[warp * NQP + nt * 8 + t4 * 2 + h] = l[nt][h];
            }
        #pragma unroll
        for (int mt = 0; mt < KS; ++mt)
            #pragma unroll
            for (int i = 0; i < 4; ++i)
                o_w[(warp * NQP + nt * 8 + t4 * 2 + (i & 1)) * D + mt * 16 + g + (i >> 1) * 8] = o[mt][nt][i];
    }
    __syncthreads();
    for (int i = tid; i < RS_NQ * D; i += RS_TC_THREADS) {
        const int qi = i / D;
        float mx = NEG_INF, acc = 0.f, sum = 0.f;
        for (int wi = 0; wi < RS_WARPS; ++wi) mx = fmaxf(mx, m_w[wi * NQP + qi]);
        for (int wi = 0; wi < RS_WARPS; ++wi) {
            const float f = m_w[wi * NQP + qi] == NEG_INF ? 0.f : exp2f(m_w[wi * NQP + qi] - mx);
            acc += f * o_w[(wi * NQP + qi) * D + i % D];
            sum += f * l_w[wi * NQP + qi];
        }
        part_acc[pbase * D + i] = acc;
        if (i % D == 0) {
            part_m[pbase + qi] = mx == NEG_INF ? mx : mx * 0.6931471805599453f;   // log2 -> natural units
            part_l[pbase + qi] = sum;
        }
    }
}
