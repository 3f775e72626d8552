// Linear layers on the blocks of a GGUF's Q4_1 / Q8_0 weights, fp32 activations (or int8 ones: a numerics of
// its own), AVX2 + FMA, AVX-512 where the build has it, and AMX tiles where the CPU has them (blocks.py). Built once per machine by
// torch.utils.cpp_extension, with -ffp-contract=off (the sums are the fma chains written here, nothing
// else fused); OpenMP through torch's own runtime.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <tuple>
#include <vector>

// Panels of 16 output rows, k-major: q4 codes [P, K, 8] (byte i of (p, k): q[16p + i, k] | q[16p + 8 + i, k] << 4),
// q8 codes [P, K, 16] int8; scales d (and mins m, q4) [P, K/32, 16] fp32. A weight is fl(fl(d * q) + m).
// One block (32 k) of a panel at a time is dequantized into wt [32, 16] (2 KB, stays in L1).
static inline void block_q4(const uint8_t* c, const float* d, const float* m, float* wt) {
  const __m128i lo = _mm_set1_epi8(0x0F);
  __m256 d0 = _mm256_loadu_ps(d), d1 = _mm256_loadu_ps(d + 8);
  __m256 m0 = _mm256_loadu_ps(m), m1 = _mm256_loadu_ps(m + 8);
  for (int k = 0; k < 32; ++k) {
    __m128i bytes = _mm_loadl_epi64((const __m128i*)(c + 8 * k));
    __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(bytes, lo)));
    __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), lo)));
    _mm256_storeu_ps(wt + 16 * k, _mm256_add_ps(_mm256_mul_ps(d0, q0), m0));
    _mm256_storeu_ps(wt + 16 * k + 8, _mm256_add_ps(_mm256_mul_ps(d1, q1), m1));
  }
}

static inline void block_q8(const int8_t* c, const float* d, float* wt) {
  __m256 d0 = _mm256_loadu_ps(d), d1 = _mm256_loadu_ps(d + 8);
  for (int k = 0; k < 32; ++k) {
    __m128i bytes = _mm_loadu_si128((const __m128i*)(c + 16 * k));
    __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
    _mm256_storeu_ps(wt + 16 * k, _mm256_mul_ps(q0, d0));
    _mm256_storeu_ps(wt + 16 * k + 8, _mm256_mul_ps(q1, d1));
  }
}

// R rows x 16 outputs over one block: every output is one chain y = fma(w[k], x[k], y) over k in order,
// carried in y between blocks (an exact fp32 store and load), the same for any R: a row's result does
// not depend on the other rows, nor on how they are grouped.
template <int R>
static inline void micro(const float* x, int64_t K, const float* wt, float* y, int64_t N) {
  __m256 a[R][2];
  for (int r = 0; r < R; ++r) { a[r][0] = _mm256_loadu_ps(y + r * N); a[r][1] = _mm256_loadu_ps(y + r * N + 8); }
  for (int k = 0; k < 32; ++k) {
    __m256 w0 = _mm256_loadu_ps(wt + 16 * k), w1 = _mm256_loadu_ps(wt + 16 * k + 8);
    for (int r = 0; r < R; ++r) {
      __m256 xb = _mm256_broadcast_ss(x + r * K + k);
      a[r][0] = _mm256_fmadd_ps(w0, xb, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(w1, xb, a[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) { _mm256_storeu_ps(y + r * N, a[r][0]); _mm256_storeu_ps(y + r * N + 8, a[r][1]); }
}

// rows r.. of one block, in groups of at most 6, sizes as even as possible (8 rows: 4 + 4)
static inline void rows_block(const float* x, int64_t M, int64_t K, const float* wt, float* y, int64_t N) {
  int64_t r = 0;
  while (r < M) {
    const int64_t left = M - r, groups = (left + 5) / 6, R = (left + groups - 1) / groups;
    const float* xr = x + r * K;
    float* yr = y + r * N;
    switch (R) {
      case 6: micro<6>(xr, K, wt, yr, N); break;
      case 5: micro<5>(xr, K, wt, yr, N); break;
      case 4: micro<4>(xr, K, wt, yr, N); break;
      case 3: micro<3>(xr, K, wt, yr, N); break;
      case 2: micro<2>(xr, K, wt, yr, N); break;
      default: micro<1>(xr, K, wt, yr, N); break;
    }
    r += R;
  }
}

#if defined(__AVX512F__)
// AVX-512: a panel's 16 outputs are one register, each block's weights are dequantized k by k in
// registers and used at once (no buffer) for a chunk of up to STREAM_ROWS rows, up to 4 panels side by
// side for few rows (one fma chain alone would wait on its own latency; 9-16 rows keep 9-16 chains in
// flight on one panel, 16 accumulators). Past `stream_rows` rows (the caller's choice, timed per
// machine in blocks.py) the AVX2 code above takes them: it dequantizes a block once for all rows, which
// wins past 8 rows where the AVX-512 units are 256 bits wide, and loses where there are two 512-bit FMA
// units (docs/ENGINE.md). Each output is the same fma
// chain over k on every path, so every build, path and chunking gives the same bits.
constexpr int64_t STREAM_ROWS = 16;
template <int BITS>
static inline __m512 weights16(const uint8_t* c, __m512 d, __m512 m, int k) {
  if (BITS == 4) {
    const __m128i lo = _mm_set1_epi8(0x0F), b = _mm_loadl_epi64((const __m128i*)(c + 8 * k));
    __m128i q = _mm_unpacklo_epi64(_mm_and_si128(b, lo), _mm_and_si128(_mm_srli_epi16(b, 4), lo));
    return _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q))), m);
  }
  __m128i b = _mm_loadu_si128((const __m128i*)(c + 16 * k));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), d);
}

// Where one block of a panel lies: codes c (cs bytes to the next panel), scales d and mins m (ds floats
// to the next panel's), outputs y (16 floats to the next panel's).
struct Panel { const uint8_t* c; int64_t cs; const float* d; const float* m; int64_t ds; float* y; };

// R rows x PN panels over one block.
template <int R, int PN, int BITS>
static inline void micro16(const float* x, int64_t K, Panel q, int64_t N) {
  __m512 a[PN][R], d[PN], m[PN];
  for (int j = 0; j < PN; ++j) {
    for (int r = 0; r < R; ++r) a[j][r] = _mm512_loadu_ps(q.y + r * N + 16 * j);
    d[j] = _mm512_loadu_ps(q.d + j * q.ds);
    m[j] = BITS == 4 ? _mm512_loadu_ps(q.m + j * q.ds) : _mm512_setzero_ps();
  }
  for (int k = 0; k < 32; ++k) {
    for (int j = 0; j < PN; ++j) {
      const __m512 w = weights16<BITS>(q.c + j * q.cs, d[j], m[j], k);
      for (int r = 0; r < R; ++r) a[j][r] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[r * K + k]), a[j][r]);
    }
  }
  for (int j = 0; j < PN; ++j)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(q.y + r * N + 16 * j, a[j][r]);
}

constexpr int side_by_side(int rows) { return rows <= 2 ? 4 : rows <= 8 ? 2 : 1; }

// R rows (at most STREAM_ROWS) of pn panels (at most 4) over one block.
template <int BITS>
static inline void group16(int64_t R, int64_t pn, const float* x, int64_t K, Panel q, int64_t N) {
  switch (R) {
#define MEDUSA_CASE(n)                                                                                 \
  case n:                                                                                              \
    if (pn == side_by_side(n)) { micro16<n, side_by_side(n), BITS>(x, K, q, N); break; }              \
    for (int64_t j = 0; j < pn; ++j)                                                                   \
      micro16<n, 1, BITS>(x, K, {q.c + j * q.cs, q.cs, q.d + j * q.ds, q.m ? q.m + j * q.ds : nullptr, \
                                 q.ds, q.y + 16 * j}, N);                                              \
    break;
    MEDUSA_CASE(16) MEDUSA_CASE(15) MEDUSA_CASE(14) MEDUSA_CASE(13) MEDUSA_CASE(12) MEDUSA_CASE(11) MEDUSA_CASE(10)
    MEDUSA_CASE(9) MEDUSA_CASE(8) MEDUSA_CASE(7) MEDUSA_CASE(6) MEDUSA_CASE(5) MEDUSA_CASE(4) MEDUSA_CASE(3) MEDUSA_CASE(2)
    MEDUSA_CASE(1)
#undef MEDUSA_CASE
  }
}
#endif

#if defined(MEDUSA_AMX)
#include <sys/syscall.h>
#include <unistd.h>
#include <array>
#include <cstring>
// AMX (Intel Xeon 4th gen and later): Q4_1 and Q8_0 layers on the tile unit. A tile product TDPBF16PS (16
// rows x 32 k x 16 outputs, fp32 sums) costs ~6 ns whether it carries 1 row or 16, so up to 16 rows cost
// about what one costs. Its inputs are bf16: each fp32 row x is split exactly into three bf16 pieces
// x = hi + mid + lo (8 + 8 + 8 significant bits), and a block's codes q (0..15, -128..127) are exact in
// bf16, so every product x q is exact and the tile unit only rounds its fp32 sums. Per block (32 k) and
// panel (16 outputs): s = sum_k x[k] q[k] from three tile products, then y = fma(s, d, y) (and for Q4_1
// y = fma(sum_k x[k], m, y)), blocks in order: fl(d q) + m is not formed, so the sums differ from the AVX
// paths' chains in the last bits (relative 1-7e-7 to F.linear, the AVX paths 6-15e-7), and each row is
// computed alone: a row's result does not depend on the other rows.
static bool amx_permission() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

struct alignas(64) TileConfig { uint8_t palette, start; uint8_t pad[14]; uint16_t colsb[16]; uint8_t rows[16]; };

// tiles 0-2: x's pieces (R rows x 32 bf16); 3, 4: a block's codes (16 k-pairs x 16 outputs x 2 bf16,
// two blocks in flight); 5, 6: their sums (R rows x 16 fp32)
static void configure(int R) {
  TileConfig c = {};
  c.palette = 1;
  for (int t = 0; t < 7; ++t) { c.rows[t] = (t == 3 || t == 4) ? 16 : R; c.colsb[t] = 64; }
  _tile_loadconfig(&c);
}

// bf16 bits of 0..15, twice (the 32 entries of a 16-bit table lookup), made once.
static const std::array<uint16_t, 32>& nibble_table() {
  alignas(64) static const std::array<uint16_t, 32> entries = [] {
    std::array<uint16_t, 32> t{};
    for (int v = 0; v < 32; ++v) { const float f = (float)(v & 15); uint32_t u; std::memcpy(&u, &f, 4); t[v] = u >> 16; }
    return t;
  }();
  return entries;
}

// One block of a panel's codes in the AMX layout (16 bytes a k-pair, byte n: q[n, 2i] | q[n, 2i + 1] << 4)
// -> the tile's rows: k-pairs of bf16 side by side (table: bf16 bits of 0..15, twice).
static inline void codes_tile(const uint8_t* c, uint16_t* buf, __m512i table) {
  const __m512i nibbles = _mm512_set1_epi32(0x000F000F);
  for (int i = 0; i < 16; ++i) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(c + 16 * i)));
    const __m512i w = _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), nibbles, 0xA8);  // (a | b) & c
    _mm512_store_si512(buf + 32 * i, _mm512_permutexvar_epi16(w, table));
  }
}

// Q8_0 codes as they are ([P, K, 16] int8: a k-pair is 16 codes of k = 2i, then 16 of 2i + 1) -> the
// tile's rows (int8 is exact in bf16: the top half of its fp32 bits).
static inline void codes_tile_q8(const uint8_t* c, uint16_t* buf) {
  const __m512i top = _mm512_set1_epi32((int)0xFFFF0000u);
  for (int i = 0; i < 16; ++i) {
    const __m128i* k2 = (const __m128i*)(c + 32 * i);
    const __m512i e = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(k2))));
    const __m512i o = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(k2 + 1))));
    _mm512_store_si512(buf + 32 * i, _mm512_ternarylogic_epi32(_mm512_srli_epi32(e, 16), o, top, 0xF8));  // a | (b & c)
  }
}

template <int BITS>
static inline void block_tile(const uint8_t* codes, int64_t b, uint16_t* buf, __m512i table) {
  if (BITS == 4) codes_tile(codes + b * 256, buf, table);
  else codes_tile_q8(codes + b * 512, buf);
}

// One block's sums [R, 16] = x's pieces (tiles 0-2, from a) times its weight tile w, in tiles W and S
// (a macro: gcc's tile intrinsics paste their tile number into the instruction).
#define MEDUSA_TILE_SUMS(W, S, a, piece_stride, K, w) \
  do {                                                \
    _tile_loadd(W, w, 64);                            \
    _tile_loadd(0, a, K * 2);                         \
    _tile_loadd(1, a + piece_stride, K * 2);          \
    _tile_loadd(2, a + 2 * piece_stride, K * 2);      \
    _tile_zero(S);                                    \
    _tile_dpbf16ps(S, 0, W);                          \
    _tile_dpbf16ps(S, 1, W);                          \
    _tile_dpbf16ps(S, 2, W);                          \
  } while (0)

// R rows (at most 16) x one panel over every block; the tile products of block b run while block b - 1's
// sums are stored and scaled into the R accumulators, and block b + 1's codes are made into a tile. A tile
// store waits for its three products: stored one block late, it no longer holds up the next block's loads
// (the same bits).
template <int R, int BITS>
static void amx_panel(const uint16_t* pieces, int64_t piece_stride, int64_t K, const float* sums, const uint8_t* codes,
                      const float* d, const float* m, float* y, int64_t N, __m512i table) {
  const int64_t B = K / 32;
  alignas(64) uint16_t tiles[2][512];
  alignas(64) float s[2][256];
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  auto scale = [&](int64_t b) {
    const __m512 dv = _mm512_loadu_ps(d + b * 16);
    if (BITS == 8) {
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_load_ps(s[b & 1] + 16 * r), dv, acc[r]);
      return;
    }
    const __m512 mv = _mm512_loadu_ps(m + b * 16);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(sums[r * B + b]), mv,
                               _mm512_fmadd_ps(_mm512_load_ps(s[b & 1] + 16 * r), dv, acc[r]));
  };
  block_tile<BITS>(codes, 0, tiles[0], table);
  for (int64_t b = 0; b < B; ++b) {
    const uint16_t* a = pieces + 32 * b;
    if (b + 1 < B) block_tile<BITS>(codes, b + 1, tiles[(b + 1) & 1], table);  // a block ahead: a tile load
    if (b & 1) MEDUSA_TILE_SUMS(4, 6, a, piece_stride, K, tiles[1]);  // waits for stores to land
    else MEDUSA_TILE_SUMS(3, 5, a, piece_stride, K, tiles[0]);
    if (b > 0) {  // block b - 1's sums, from the other tile
      if (b & 1) _tile_stored(5, s[0], 64);
      else _tile_stored(6, s[1], 64);
      scale(b - 1);
    }
  }
  if ((B - 1) & 1) _tile_stored(6, s[1], 64);
  else _tile_stored(5, s[0], 64);
  scale(B - 1);
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * N, acc[r]);
}
#undef MEDUSA_TILE_SUMS

// x [M, K] -> y [M, N] on a Q4_1 layer's codes in the AMX layout [P, K/2, 16], or a Q8_0 layer's [P, K, 16]
static torch::Tensor amx_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor d, torch::Tensor m, int64_t bits) {
  TORCH_CHECK(amx_permission(), "the OS did not grant this process the AMX tiles");
  const int64_t M = x.size(0), K = x.size(1), P = codes.size(0), N = 16 * P, B = K / 32;
  auto y = torch::empty({M, N}, x.options());
  auto pieces = torch::empty({3, M, K}, x.options().dtype(torch::kBFloat16));  // hi, mid, lo
  auto sums = torch::empty({M, B}, x.options());  // sum of each block of x, for the mins
  const float* xp = x.data_ptr<float>();
  uint16_t* pp = (uint16_t*)pieces.data_ptr();
  float* sp = sums.data_ptr<float>();
  auto widen = [](__m256bh h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16)); };
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < B; ++b) {
      const int64_t o = r * K + 32 * b;
      const __m512 v0 = _mm512_loadu_ps(xp + o), v1 = _mm512_loadu_ps(xp + o + 16);
      for (int h = 0; h < 2; ++h) {
        const __m512 v = h ? v1 : v0;
        const __m256bh hi = _mm512_cvtneps_pbh(v);
        const __m512 rest = _mm512_sub_ps(v, widen(hi));  // exact: x and hi agree in their top bits
        const __m256bh mid = _mm512_cvtneps_pbh(rest);
        const __m256bh lo = _mm512_cvtneps_pbh(_mm512_sub_ps(rest, widen(mid)));  // exact, and exact in bf16
        _mm256_storeu_si256((__m256i*)(pp + o + 16 * h), (__m256i)hi);
        _mm256_storeu_si256((__m256i*)(pp + M * K + o + 16 * h), (__m256i)mid);
        _mm256_storeu_si256((__m256i*)(pp + 2 * M * K + o + 16 * h), (__m256i)lo);
      }
      sp[r * B + b] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
    }
  float* yp = y.data_ptr<float>();
  const float* dp = d.data_ptr<float>();
  const float* mp = bits == 4 ? m.data_ptr<float>() : nullptr;
  const uint8_t* cp = (const uint8_t*)codes.data_ptr();
  const __m512i table = _mm512_load_si512(nibble_table().data());
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    int configured = 0;  // the tile configuration is each thread's own
    for (int64_t r0 = 0; r0 < M; r0 += 16) {
      const int R = (int)std::min<int64_t>(16, M - r0);
      if (R != configured) { configure(R); configured = R; }
      for (int64_t p = begin; p < end; ++p) {
        const uint16_t* a = pp + r0 * K;
        const float *s = sp + r0 * B, *dd = dp + p * B * 16, *mm = mp ? mp + p * B * 16 : nullptr;
        const uint8_t* c = cp + p * K * (bits == 4 ? 8 : 16);
        float* yy = yp + r0 * N + 16 * p;
        switch (R) {
#define MEDUSA_CASE(n)                                                                \
  case n:                                                                             \
    if (bits == 4) amx_panel<n, 4>(a, M * K, K, s, c, dd, mm, yy, N, table);          \
    else amx_panel<n, 8>(a, M * K, K, s, c, dd, mm, yy, N, table);                    \
    break;
          MEDUSA_CASE(1) MEDUSA_CASE(2) MEDUSA_CASE(3) MEDUSA_CASE(4) MEDUSA_CASE(5) MEDUSA_CASE(6) MEDUSA_CASE(7)
          MEDUSA_CASE(8) MEDUSA_CASE(9) MEDUSA_CASE(10) MEDUSA_CASE(11) MEDUSA_CASE(12) MEDUSA_CASE(13) MEDUSA_CASE(14)
          MEDUSA_CASE(15) MEDUSA_CASE(16)
#undef MEDUSA_CASE
        }
      }
    }
    if (configured) _tile_release();
  });
  return y;
}
#endif

// The int8 numerics (`Numerics.INT8`, blocks.py): each row of x is quantized per block of 32 to int8
// codes c = round(x / e), e = max |x| / 127 (llama.cpp's Q8_1 activations, kept in fp32), and a block's
// dot products with the weight codes are integer sums, exact; per block and output the row's result
// gains fl(d e) * sum (Q4_1: + m * fl(e * sum c)), blocks in order. So a row's result depends on that
// row alone, as on the fp32 paths, at a fraction of their work: an integer multiply-add
// (`vpmaddubsw`) takes 32 products where an fp32 fma takes 8, and no weight is converted to float.
// Codes in this path's layout: Q4_1 [P, K/4, 32] bytes, byte 4o + j: q[16p + o, 4g + j] | q[16p + 8 + o,
// 4g + j] << 4 (k-group g of 4); Q8_0 [P, K/4, 64] int8, bytes 4o + j of outputs 0-7, then of 8-15.
struct Quantized { torch::Tensor codes, e, s; };

static Quantized quantize_rows(const torch::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), B = K / 32;
  Quantized q{torch::empty({M, K}, x.options().dtype(torch::kInt8)), torch::empty({M, B}, x.options()),
              torch::empty({M, B}, x.options())};
  const float* xp = x.data_ptr<float>();
  int8_t* cp = q.codes.data_ptr<int8_t>();
  float *ep = q.e.data_ptr<float>(), *sp = q.s.data_ptr<float>();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t i = 0; i < M * B; ++i) {
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xp + 32 * i + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, amax);
    float top = lanes[0];
    for (int j = 1; j < 8; ++j) top = std::max(top, lanes[j]);
    const float e = top / 127.0f, inv = top > 0 ? 127.0f / top : 0.0f;
    __m256i c[4], sum = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {  // |x / e| <= 127: no saturation below
      c[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(inv)));  // rounding to nearest, ties to even
      sum = _mm256_add_epi32(sum, c[j]);
    }
    const __m256i packed = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3])), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i*)(cp + 32 * i), packed);
    alignas(32) int32_t parts[8];
    _mm256_store_si256((__m256i*)parts, sum);
    int total = 0;
    for (int j = 0; j < 8; ++j) total += parts[j];
    ep[i] = e;
    sp[i] = e * (float)total;
  }
  return q;
}

// R rows x one panel (16 outputs) of a Q4_1 layer over every block. Within a block the products go to 16-bit
// sums (|q x| <= 15 x 127, 16 of them to a lane: <= 30,480, no overflow), then to 32 bits and float.
template <int R>
static inline void int8_q4(const int8_t* xc, int64_t K, const float* e, const float* s, int64_t B, const uint8_t* c,
                           const float* d, const float* m, float* y, int64_t N) {
  const __m256i lo = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r) { _mm256_storeu_ps(y + r * N, _mm256_setzero_ps()); _mm256_storeu_ps(y + r * N + 8, _mm256_setzero_ps()); }
  for (int64_t b = 0; b < B; ++b) {
    __m256i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int g = 0; g < 8; ++g) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(c + 256 * b + 32 * g));
      const __m256i w0 = _mm256_and_si256(v, lo), w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo);
      for (int r = 0; r < R; ++r) {
        const __m256i xb = _mm256_set1_epi32(*(const int32_t*)(xc + r * K + 32 * b + 4 * g));
        acc[r][0] = _mm256_add_epi16(acc[r][0], _mm256_maddubs_epi16(w0, xb));
        acc[r][1] = _mm256_add_epi16(acc[r][1], _mm256_maddubs_epi16(w1, xb));
      }
    }
    const __m256 d0 = _mm256_loadu_ps(d + 16 * b), d1 = _mm256_loadu_ps(d + 16 * b + 8);
    const __m256 m0 = _mm256_loadu_ps(m + 16 * b), m1 = _mm256_loadu_ps(m + 16 * b + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 eb = _mm256_set1_ps(e[r * B + b]), sb = _mm256_set1_ps(s[r * B + b]);
      const __m256 f0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[r][0], ones));
      const __m256 f1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[r][1], ones));
      _mm256_storeu_ps(y + r * N, _mm256_fmadd_ps(m0, sb, _mm256_fmadd_ps(_mm256_mul_ps(d0, eb), f0, _mm256_loadu_ps(y + r * N))));
      _mm256_storeu_ps(y + r * N + 8,
                       _mm256_fmadd_ps(m1, sb, _mm256_fmadd_ps(_mm256_mul_ps(d1, eb), f1, _mm256_loadu_ps(y + r * N + 8))));
    }
  }
}

// The same for a Q8_0 layer: signed codes, so |q| times x with q's sign (llama.cpp's trick: the unsigned
// operand must be the weight's magnitude, <= 128), in 32-bit sums per group of 4.
template <int R>
static inline void int8_q8(const int8_t* xc, int64_t K, const float* e, int64_t B, const int8_t* c, const float* d,
                           float* y, int64_t N) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r) { _mm256_storeu_ps(y + r * N, _mm256_setzero_ps()); _mm256_storeu_ps(y + r * N + 8, _mm256_setzero_ps()); }
  for (int64_t b = 0; b < B; ++b) {
    __m256i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int g = 0; g < 8; ++g) {
      const __m256i v0 = _mm256_loadu_si256((const __m256i*)(c + 512 * b + 64 * g));
      const __m256i v1 = _mm256_loadu_si256((const __m256i*)(c + 512 * b + 64 * g + 32));
      const __m256i a0 = _mm256_sign_epi8(v0, v0), a1 = _mm256_sign_epi8(v1, v1);
      for (int r = 0; r < R; ++r) {
        const __m256i xb = _mm256_set1_epi32(*(const int32_t*)(xc + r * K + 32 * b + 4 * g));
        acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(xb, v0)), ones));
        acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(xb, v1)), ones));
      }
    }
    const __m256 d0 = _mm256_loadu_ps(d + 16 * b), d1 = _mm256_loadu_ps(d + 16 * b + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 eb = _mm256_set1_ps(e[r * B + b]);
      _mm256_storeu_ps(y + r * N, _mm256_fmadd_ps(_mm256_mul_ps(d0, eb), _mm256_cvtepi32_ps(acc[r][0]), _mm256_loadu_ps(y + r * N)));
      _mm256_storeu_ps(y + r * N + 8,
                       _mm256_fmadd_ps(_mm256_mul_ps(d1, eb), _mm256_cvtepi32_ps(acc[r][1]), _mm256_loadu_ps(y + r * N + 8)));
    }
  }
}

// x [M, K] fp32 contiguous -> y [M, N] in the int8 numerics; codes in this path's layout (above), d, m as
// for blocks_linear. Rows in groups of at most 6 (12 accumulators), sizes as even as possible.
torch::Tensor blocks_linear_int8(torch::Tensor x, torch::Tensor codes, torch::Tensor d, torch::Tensor m, int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32, "x: [M, K] contiguous fp32");
  TORCH_CHECK(x.size(1) % 32 == 0 && codes.size(1) * 4 == x.size(1), "int8 codes: [P, K/4, 32 or 64]");
  const int64_t M = x.size(0), K = x.size(1), P = codes.size(0), N = 16 * P, B = K / 32;
  const Quantized q = quantize_rows(x);
  auto y = torch::empty({M, N}, x.options());
  const int8_t* xc = q.codes.data_ptr<int8_t>();
  const float *ep = q.e.data_ptr<float>(), *sp = q.s.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float* dp = d.data_ptr<float>();
  const float* mp = bits == 4 ? m.data_ptr<float>() : nullptr;
  const uint8_t* cp = (const uint8_t*)codes.data_ptr();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* dd = dp + p * B * 16;
      for (int64_t r = 0; r < M;) {
        const int64_t left = M - r, groups = (left + 5) / 6, R = (left + groups - 1) / groups;
        const int8_t* xr = xc + r * K;
        const float *er = ep + r * B, *sr = sp + r * B;
        float* yr = yp + r * N + 16 * p;
        if (bits == 4) {
          const uint8_t* c = cp + p * K * 8;
          const float* mm = mp + p * B * 16;
          switch (R) {
            case 6: int8_q4<6>(xr, K, er, sr, B, c, dd, mm, yr, N); break;
            case 5: int8_q4<5>(xr, K, er, sr, B, c, dd, mm, yr, N); break;
            case 4: int8_q4<4>(xr, K, er, sr, B, c, dd, mm, yr, N); break;
            case 3: int8_q4<3>(xr, K, er, sr, B, c, dd, mm, yr, N); break;
            case 2: int8_q4<2>(xr, K, er, sr, B, c, dd, mm, yr, N); break;
            default: int8_q4<1>(xr, K, er, sr, B, c, dd, mm, yr, N); break;
          }
        } else {
          const int8_t* c = (const int8_t*)cp + p * K * 16;
          switch (R) {
            case 6: int8_q8<6>(xr, K, er, B, c, dd, yr, N); break;
            case 5: int8_q8<5>(xr, K, er, B, c, dd, yr, N); break;
            case 4: int8_q8<4>(xr, K, er, B, c, dd, yr, N); break;
            case 3: int8_q8<3>(xr, K, er, B, c, dd, yr, N); break;
            case 2: int8_q8<2>(xr, K, er, B, c, dd, yr, N); break;
            default: int8_q8<1>(xr, K, er, B, c, dd, yr, N); break;
          }
        }
        r += R;
      }
    }
  });
  return y;
}

// Attention for the int8 numerics (attention.py's rowwise_attention): each query alone, over the keys it
// attends in slot order (its "virtual sequence": the prefix, then its tree ancestors, as plain decoding lays
// them out), every sum in that order. A query's result depends on its own keys only, never on the other
// queries, the cache's width or the tree's shape: a tree node gets what plain decoding computes at its
// position, bit for bit. (In int8 a last-bit difference before a layer can move a code by one step, so
// the fp32 kernel's GEMMs, whose rounding depends on their row count, would break speculation's identity.)
// q [B, H, n, d], k and v [B, G, S, d] fp32 contiguous, attend [B, n, S] bool -> [B, n, H, d].
static inline float dot8(const float* a, const float* b, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}

torch::Tensor rowwise_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor attend, double scaling) {
  TORCH_CHECK(q.dim() == 4 && q.is_contiguous() && q.scalar_type() == torch::kFloat32, "q: [B, H, n, d] contiguous fp32");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && k.scalar_type() == torch::kFloat32, "k, v: [B, G, S, d] contiguous fp32");
  const int64_t B = q.size(0), H = q.size(1), n = q.size(2), d = q.size(3), G = k.size(1), S = k.size(2), R = H / G;
  TORCH_CHECK(d % 8 == 0 && attend.size(-1) == S && attend.size(-2) == n, "d a multiple of 8; attend [B, n, S]");
  auto out = torch::empty({B, n, H, d}, q.options());
  auto att = attend.to(torch::kBool).expand({B, n, S}).contiguous();
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const bool* ap = att.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const float scale = (float)scaling;
  at::parallel_for(0, B * n * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> slots;
    std::vector<float> e;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (n * H), i = task / H % n, h = task % H, g = h / R;
      const bool* a = ap + (b * n + i) * S;
      slots.clear();
      for (int64_t j = 0; j < S; ++j) if (a[j]) slots.push_back(j);
      const float* qv = qp + ((b * H + h) * n + i) * d;
      const float* kb = kp + (b * G + g) * S * d;
      const float* vb = vp + (b * G + g) * S * d;
      float* o = op + ((b * n + i) * H + h) * d;
      const int64_t T = (int64_t)slots.size();
      if (T == 0) { std::fill(o, o + d, 0.0f); continue; }
      e.resize(T);
      float top = -INFINITY;
      for (int64_t t = 0; t < T; ++t) { e[t] = dot8(qv, kb + slots[t] * d, d) * scale; top = std::max(top, e[t]); }
      float total = 0.0f;
      for (int64_t t = 0; t < T; ++t) { e[t] = std::exp(e[t] - top); total += e[t]; }
      for (int64_t c = 0; c < d; c += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t t = 0; t < T; ++t) acc = _mm256_fmadd_ps(_mm256_set1_ps(e[t]), _mm256_loadu_ps(vb + slots[t] * d + c), acc);
        _mm256_storeu_ps(o + c, _mm256_div_ps(acc, _mm256_set1_ps(total)));
      }
    }
  });
  return out;
}

// One block's codes and scale from the 32 fp32 values a GGUF reader dequantized it to: q4 (Q4_1), m the
// block's minimum (fp16-exact) and d one of the three fp16 values around (max - min) / 15; q8 (Q8_0),
// m = 0 and d around max |v| / 127. Tried in that order, the first d with which fl(fl(d q) + m) gives
// every value back bit for bit wins (no fused multiply-add: -ffp-contract=off); false where none does.
static bool recover_block(const float* v, bool q4, uint8_t* q, float* d, float* m) {
  float lo = v[0], hi = v[0], amax = std::fabs(v[0]);
  for (int k = 1; k < 32; ++k) {
    lo = std::min(lo, v[k]);
    hi = std::max(hi, v[k]);
    amax = std::max(amax, std::fabs(v[k]));
  }
  const float mv = q4 ? lo : 0.0f, top = q4 ? 15.0f : 127.0f, qlo = q4 ? 0.0f : -128.0f;
  if (q4 && static_cast<float>(c10::Half(mv)) != mv) return false;
  const uint16_t h = c10::Half((q4 ? hi - lo : amax) / top).x;
  for (uint16_t bits : {h, static_cast<uint16_t>(h - 1), static_cast<uint16_t>(h + 1)}) {
    float c = static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
    if (!(std::isfinite(c) && c > 0)) c = 0.0f;
    const float safe = c > 0 ? c : 1.0f;
    alignas(32) float codes[32];
    bool hit = true;
    for (int k = 0; k < 32 && hit; ++k) {
      float qc = std::min(std::max(std::nearbyint((v[k] - mv) / safe), qlo), top) * (c > 0 ? 1.0f : 0.0f);
      float prod = c * qc;
      float back = q4 ? prod + mv : prod;
      hit = back == v[k];
      codes[k] = qc;
    }
    if (hit) {
      for (int k = 0; k < 32; ++k) q[k] = q4 ? static_cast<uint8_t>(codes[k]) : static_cast<uint8_t>(static_cast<int8_t>(codes[k]));
      *d = c;
      *m = mv;
      return true;
    }
  }
  return false;
}

// v [B, 32] fp32 contiguous (a weight's blocks), bits 4 (Q4_1) or 8 (Q8_0) -> (q [B, 32] uint8: the codes,
// Q8_0's as int8 bits; d [B]; m [B]; whether every block was rebuilt bit for bit).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, bool> blocks_recover(torch::Tensor v, int64_t bits) {
  TORCH_CHECK(v.dim() == 2 && v.size(1) == 32 && v.is_contiguous() && v.scalar_type() == torch::kFloat32,
              "v: [B, 32] contiguous fp32");
  const int64_t B = v.size(0);
  auto q = torch::empty({B, 32}, torch::kUInt8);
  auto d = torch::empty({B}, torch::kFloat32), m = torch::empty({B}, torch::kFloat32);
  const float* vp = v.data_ptr<float>();
  uint8_t* qp = q.data_ptr<uint8_t>();
  float *dp = d.data_ptr<float>(), *mp = m.data_ptr<float>();
  std::atomic<bool> ok{true};
  at::parallel_for(0, B, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end && ok.load(std::memory_order_relaxed); ++b)
      if (!recover_block(vp + 32 * b, bits == 4, qp + 32 * b, dp + b, mp + b)) ok.store(false, std::memory_order_relaxed);
  });
  return {q, d, m, ok.load()};
}

// Whether this build and process can run the AMX path (the build has it, the OS grants the tiles).
bool amx_ready() {
#if defined(MEDUSA_AMX)
  return amx_permission();
#else
  return false;
#endif
}

// x [M, K] fp32 contiguous -> y [M, N]; codes/d/m as above, bits 4 (Q4_1) or 8 (Q8_0; m unused);
// stream_rows: the most rows the AVX-512 path takes (in chunks of at most STREAM_ROWS), AVX2 above;
// amx: on the tile unit (every row count; Q4_1 codes in the AMX layout, Q8_0 codes as they are).
torch::Tensor blocks_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor d, torch::Tensor m, int64_t bits,
                            int64_t stream_rows, bool amx) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32, "x: [M, K] contiguous fp32");
  if (amx) {
#if defined(MEDUSA_AMX)
    TORCH_CHECK(x.size(1) == codes.size(1) * (bits == 4 ? 2 : 1) && x.size(1) % 32 == 0,
                "AMX: Q4_1 codes [P, K/2, 16] or Q8_0 codes [P, K, 16]");
    return amx_linear(x, codes, d, m, bits);
#else
    TORCH_CHECK(false, "this build of the kernel has no AMX path");
#endif
  }
  TORCH_CHECK(x.size(1) == codes.size(1) && x.size(1) % 32 == 0, "x's K must match the codes' and be a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1), P = codes.size(0), N = 16 * P, B = K / 32;
  auto y = torch::zeros({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float* dp = d.data_ptr<float>();
  const float* mp = bits == 4 ? m.data_ptr<float>() : nullptr;
  const uint8_t* cp = (const uint8_t*)codes.data_ptr();
#if defined(__AVX512F__)
  if (M <= stream_rows) {
    at::parallel_for(0, (P + 3) / 4, 1, [&](int64_t begin, int64_t end) {  // 4 panels a task
      for (int64_t p = 4 * begin; p < std::min(4 * end, P); p += 4) {
        const int64_t pn = std::min<int64_t>(4, P - p), cs = K * (bits == 4 ? 8 : 16);
        for (int64_t b = 0; b < B; ++b) {
          const Panel q = {cp + p * cs + 32 * b * (bits == 4 ? 8 : 16), cs, dp + (p * B + b) * 16,
                           bits == 4 ? mp + (p * B + b) * 16 : nullptr, B * 16, yp + 16 * p};
          for (int64_t r = 0; r < M;) {  // chunks of at most STREAM_ROWS rows, sizes as even as possible
            const int64_t left = M - r, groups = (left + STREAM_ROWS - 1) / STREAM_ROWS, R = (left + groups - 1) / groups;
            Panel qr = q;
            qr.y = q.y + r * N;
            if (bits == 4) group16<4>(R, pn, xp + r * K + 32 * b, K, qr, N);
            else group16<8>(R, pn, xp + r * K + 32 * b, K, qr, N);
            r += R;
          }
        }
      }
    });
    return y;
  }
#endif
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    alignas(32) float wt[32 * 16];
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t b = 0; b < B; ++b) {
        if (bits == 4) block_q4(cp + (p * K + 32 * b) * 8, dp + (p * B + b) * 16, mp + (p * B + b) * 16, wt);
        else block_q8((const int8_t*)cp + (p * K + 32 * b) * 16, dp + (p * B + b) * 16, wt);
        rows_block(xp + 32 * b, M, K, wt, yp + 16 * p, N);
      }
    }
  });
  return y;
}

// A dispatcher operator, so that torch.compile can call the kernel inside a graph (blocks.py registers
// its shape function). A build for comparison (MEDUSA_NO_OP) registers none: one library per namespace.
#ifndef MEDUSA_NO_OP
TORCH_LIBRARY(medusa_blocks, m) {
  m.def("linear(Tensor x, Tensor codes, Tensor d, Tensor m, int bits, int stream_rows, bool amx) -> Tensor");
  m.def("linear_int8(Tensor x, Tensor codes, Tensor d, Tensor m, int bits) -> Tensor");
  m.def("rowwise_attention(Tensor q, Tensor k, Tensor v, Tensor attend, float scaling) -> Tensor");
}
TORCH_LIBRARY_IMPL(medusa_blocks, CPU, m) {
  m.impl("linear", &blocks_linear);
  m.impl("linear_int8", &blocks_linear_int8);
  m.impl("rowwise_attention", &rowwise_attention);
}
#endif
