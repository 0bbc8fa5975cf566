// AMX tiles for the csrc CPU kernels: whether the CPU has them and this process may use them, and
// the one tile configuration every kernel loads (every tile 16 rows x 64 bytes), for the attention
// kernels (cpu_ops.cpp: bf16 scores; kv_int8_ops.cpp: int8 scores) and the linear ones
// (bf16_linear_ops.cpp, int8_linear_ops.cpp), whose work split (amx_gemm), copy of x into A tiles
// (amx_a_tiles) and tile product (amx_block_product) are here too. The compiler emits no AMX
// instruction of its own: the kernels call these only where cpu_has_amx() says so.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define VLLM_LITE_AMX 1
#else
#define VLLM_LITE_AMX 0
#endif

#if VLLM_LITE_AMX && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

namespace vllm_lite_cpu {

enum class AmxKind { kBf16, kInt8 };

// The CPU's AMX for `kind`, and the tile registers' state granted to this process (Linux hands it
// out on request, once per process; oneDNN asks too).
inline bool cpu_has_amx(AmxKind kind) {
#if VLLM_LITE_AMX && defined(__linux__)
  static const bool permitted = [] {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("avx512bw")) return false;
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  if (kind == AmxKind::kBf16) return permitted && __builtin_cpu_supports("amx-bf16") && __builtin_cpu_supports("avx512bf16");
  return permitted && __builtin_cpu_supports("amx-int8") && __builtin_cpu_supports("avx512vnni");
#else
  (void)kind;
  return false;
#endif
}

// The attention kernels' AMX paths take head_dim 64 or 128 (whole 64-byte tile rows), blocks of
// whole 16-row tiles and at most 16 query heads per KV head (a tile's columns).
inline bool amx_tiles_fit(int64_t head_dim, int64_t block_size, int64_t group) {
  return (head_dim == 64 || head_dim == 128) && block_size % 16 == 0 && group <= 16;
}

#if VLLM_LITE_AMX
// Functions that issue AMX-BF16 tile instructions (and the AVX-512 BF16 conversions around them);
// they run only where cpu_has_amx(AmxKind::kBf16) says so.
#define VLLM_LITE_AMX_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

struct alignas(64) AmxTileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles [0, num_tiles) as 16 rows x 64 bytes, for the calling thread (tile configuration is thread
// state; oneDNN's matmuls load their own).
__attribute__((target("amx-tile"))) inline void load_tile_config(int64_t num_tiles) {
  AmxTileConfig config;
  std::memset(&config, 0, sizeof config);
  config.palette = 1;
  for (int64_t t = 0; t < num_tiles; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  // GCC (12) takes ldtilecfg to read 16 bytes and drops the stores of the other 48 as dead: the
  // unused tiles' fields were left as stack garbage and ldtilecfg faulted. The barrier keeps them.
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

__attribute__((target("amx-tile"))) inline void release_tiles() { _tile_release(); }

// The rows of each thread's share of an AMX GEMM (the linear kernels': bf16_linear_ops.cpp,
// int8_linear_ops.cpp): ~300 KB of x at K = 576, kept in L2 across column blocks.
constexpr int64_t kAmxRowBlock = 256;

// An AMX linear kernel's work handed out to `threads` threads: items of (kAmxRowBlock rows, a run
// of ~64 KB of 2 KB weight blocks), taken dynamically so that a thread that starts late (another
// process on the core) takes fewer, each thread loading the tile configuration first.
// `range(g, row_begin, row_end, first, last)` computes rows [row_begin, row_end) by column
// blocks [first, last).
template <typename Operands>
void amx_gemm(const Operands& g, int64_t rows, int64_t k_blocks, int64_t column_blocks, int threads,
              void (*range)(const Operands&, int64_t, int64_t, int64_t, int64_t)) {
  const int64_t row_blocks = (rows + kAmxRowBlock - 1) / kAmxRowBlock;
  const int64_t run = k_blocks >= 32 ? 1 : 32 / k_blocks;
  const int64_t runs = (column_blocks + run - 1) / run;
  const int64_t items = row_blocks * runs;
  auto work = [&](int64_t item) {
    const int64_t rb = item / runs, first = (item % runs) * run;
    const int64_t last = first + run < column_blocks ? first + run : column_blocks;
    range(g, rb * kAmxRowBlock, (rb + 1) * kAmxRowBlock < rows ? (rb + 1) * kAmxRowBlock : rows, first, last);
  };
  if (threads <= 1 || items == 1) {
    load_tile_config(8);
    for (int64_t item = 0; item < items; ++item) work(item);
    release_tiles();
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    load_tile_config(8);  // per thread: the tile configuration is thread state
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) work(item);
    release_tiles();
  }
}

// The linear kernels' inner product (bf16_linear_ops.cpp, int8_linear_ops.cpp): one 32-column
// block of the weight over all of K times 1 or 2 row tiles of x (rows [row, row + 16 * kRowTiles)),
// into 2 or 4 C tiles stored at c (row stride c_stride sums). In bytes the two kinds lie alike: a
// tile row is 64 bytes (32 bf16 or 64 int8 values of K), a (column block, K block) of the weight is
// 2 KB whose two B tiles are the halves of its 128-byte rows, one block's K blocks follow each
// other (a stretch a thread streams start to end), x's tiles are amx_a_tiles'. bf16 (uint16_t)
// operands are summed in fp32 by tdpbf16ps, int8 ones in int32 by tdpbssd. Tiles: 0-3 C, 4-5 A
// (x), 6-7 B (weights).
constexpr int64_t kAmxTileBytes = 1024;
constexpr int64_t kAmxWeightBlockBytes = 2048;
constexpr int64_t kAmxPrefetchBlocks = 4;  // weight blocks asked for ahead (prefetch never faults)

template <int kRowTiles, typename T, typename Sum>
__attribute__((target("amx-tile,amx-bf16,amx-int8"))) void amx_block_product(const T* x_tiles, const T* weight,
                                                                              int64_t k_blocks, int64_t row,
                                                                              int64_t block, Sum* c,
                                                                              int64_t c_stride) {
  constexpr bool kInt8 = sizeof(T) == 1;
  static_assert(sizeof(Sum) == 4 && (kInt8 || sizeof(T) == 2), "bf16 pairs into fp32, or int8 quads into int32");
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (kRowTiles == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const char* a0 = reinterpret_cast<const char*>(x_tiles) + row / 16 * k_blocks * kAmxTileBytes;
  const char* a1 = a0 + k_blocks * kAmxTileBytes;
  const char* b = reinterpret_cast<const char*>(weight) + block * k_blocks * kAmxWeightBlockBytes;
  for (int64_t k = 0; k < k_blocks; ++k, b += kAmxWeightBlockBytes) {
    const char* ahead = b + kAmxPrefetchBlocks * kAmxWeightBlockBytes;
    for (int64_t line = 0; line < kAmxWeightBlockBytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    _tile_loadd(6, b, 128);
    _tile_loadd(7, b + 64, 128);  // the second 16 columns: the rows' second 64 bytes
    _tile_loadd(4, a0 + k * kAmxTileBytes, 64);
    if constexpr (kInt8) {
      _tile_dpbssd(0, 4, 6);
      _tile_dpbssd(1, 4, 7);
    } else {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (kRowTiles == 2) {
      _tile_loadd(5, a1 + k * kAmxTileBytes, 64);
      if constexpr (kInt8) {
        _tile_dpbssd(2, 5, 6);
        _tile_dpbssd(3, 5, 7);
      } else {
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
  }
  const int64_t bytes = c_stride * 4;
  _tile_stored(0, c, bytes);
  _tile_stored(1, c + 16, bytes);
  if constexpr (kRowTiles == 2) {
    _tile_stored(2, c + 16 * c_stride, bytes);
    _tile_stored(3, c + 16 * c_stride + 16, bytes);
  }
}

// amx_block_product for row_tiles (1 or 2) known at run time.
template <typename T, typename Sum>
__attribute__((target("amx-tile,amx-bf16,amx-int8"))) void amx_block_product(const T* x_tiles, const T* weight,
                                                                              int64_t k_blocks, int64_t row,
                                                                              int row_tiles, int64_t block, Sum* c,
                                                                              int64_t c_stride) {
  if (row_tiles == 2)
    amx_block_product<2>(x_tiles, weight, k_blocks, row, block, c, c_stride);
  else
    amx_block_product<1>(x_tiles, weight, k_blocks, row, block, c, c_stride);
}

// Rows copied into whole A tiles, [row tiles][K blocks][16 rows][block_k] (zero-padded): each
// tile one piece in memory, which the tile loads stream from L2 where strided rows of x each
// cost a cache line of their own. `row_values(r, scratch)` gives row r's in_features values: x's
// row itself, or values it wrote into `scratch` (room for in_features). The row tiles are filled by
// `threads` threads (a prefill chunk's rows are megabytes), and only the padding is zeroed.
template <typename T, typename RowValues>
std::unique_ptr<T[]> amx_a_tiles_of(int64_t rows, int64_t in_features, int64_t block_k, int threads,
                                    const RowValues& row_values) {
  const int64_t k_blocks = (in_features + block_k - 1) / block_k, tile = 16 * block_k, row_tiles = (rows + 15) / 16;
  std::unique_ptr<T[]> tiles(new T[row_tiles * k_blocks * tile]);
  T* const packed = tiles.get();
#pragma omp parallel for num_threads(threads) if (threads > 1 && row_tiles > 1)
  for (int64_t row_tile = 0; row_tile < row_tiles; ++row_tile) {
    const std::unique_ptr<T[]> scratch(new T[in_features]);
    for (int64_t r = row_tile * 16; r < row_tile * 16 + 16; ++r) {
      const T* values = r < rows ? row_values(r, scratch.get()) : nullptr;
      for (int64_t k = 0; k < k_blocks; ++k) {
        T* const out = packed + (row_tile * k_blocks + k) * tile + (r % 16) * block_k;
        const int64_t width = values == nullptr ? 0 : std::min(block_k, in_features - k * block_k);
        if (width > 0) std::memcpy(out, values + k * block_k, width * sizeof(T));
        std::memset(out + width, 0, (block_k - width) * sizeof(T));
      }
    }
  }
  return tiles;
}

// x's rows, `row_stride` apart, in whole A tiles; by `threads` threads from 256 KB of them (below,
// a copy costs less than waking them).
template <typename T>
std::unique_ptr<T[]> amx_a_tiles(const T* x, int64_t rows, int64_t row_stride, int64_t in_features, int64_t block_k,
                                 int threads) {
  const bool large = rows * in_features * static_cast<int64_t>(sizeof(T)) >= (256 << 10);
  return amx_a_tiles_of<T>(rows, in_features, block_k, large ? threads : 1,
                           [&](int64_t r, T*) { return x + r * row_stride; });
}
#endif

}  // namespace vllm_lite_cpu
