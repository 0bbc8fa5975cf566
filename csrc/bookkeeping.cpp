// vllm_lite._bookkeeping: a steady step's loops over every running request (the engine core's,
// the worker's decode step inputs, block-table rows and sampled tokens, the client's output
// tokens) and the prefix cache's block keys, in C. A plain CPython extension (no torch, no numpy
// C API: arrays arrive through the buffer protocol), so that core/ may use it; each function has
// a numpy (or hashlib) twin in the module that calls it (for the worker's, its general path),
// used when this extension is not built, and the tests run both on the same random steps.
//
// Why: between two forward passes each numpy call costs far more than its arithmetic (its code
// and a fresh temporary to fetch, per call and per element); one loop that reads each request's
// entries once does a dozen calls' work for the cost of one (measured at 64 and 1,024 requests:
// benchmarks/RESULTS.md, thirty-third session).
//
//   store_append(slots, tokens, token_ids, tail, num_tokens, look_at_len, min_stop_len,
//                length_limit, each_step, stop_ids, looked_at) -> int
//       core/token_store.py's TokenStore.append: see there. A token goes into its slot's `tail`
//       row (int32 [num_slots, T]) at its position % T, and the T tokens of a tail row into
//       the slot's `token_ids` row when the last of them arrives. `looked_at` (int64, at least
//       len(slots) long) receives the positions Python must look at; returns how many.
//   running_scan(slots, with_placeholders, computed, length_limit, held, block_size, known,
//                computed_out, to_allocate, new_blocks) -> (every_one, total, min_new,
//                num_to_allocate, num_new_blocks)
//   running_advance(slots, known, computed, with_placeholders) -> None
//       TokenStore.scan_running / advance_running (the scheduler's running part of a step):
//       see there. The outputs are int64 arrays of len(slots) the caller made.
//   decode_inputs(num_computed, num_tokens, last_token_ids, block_ids, block_size, positions,
//                 seq_lens, slot_mapping, input_ids) -> int
//       The worker's inputs of a decode step over batch rows 0..n-1 (n = len(positions)), one
//       token each (worker/model_runner.py, ModelRunner._decode_step_inputs): each row's
//       position, sequence length, KV slot and input token. Returns the longest sequence, or -1
//       when some row's token is not its last (the general path then builds the step).
//   copy_block_rows(block_ids, block_table) -> None
//       The first block_table.shape[1] block ids of rows 0..block_table.shape[0]-1.
//   block_rows_append(rows, counts, new_block_ids, block_ids, num_blocks) -> None
//       worker/block_table.py's BlockTable.append_rows: row rows[i] (distinct) takes the next
//       counts[i] (int32, >= 0) of `new_block_ids` after its num_blocks[rows[i]]; every row's
//       room is checked before anything is written (ValueError naming the row), and a row named
//       twice is never written past its end (IndexError).
//   sampled_count(rows, num_tokens, row_serial, positions, serials) -> None
//       ModelRunner._count_sampled: each row's next position (its num_tokens, int32) into
//       `positions` and its `row_serial` (int64) into `serials` (both len(rows), made by the
//       caller); the row's num_tokens moves on by one.
//   sampled_write(rows, positions, tokens, token_ids, last_token_ids, sampled, num_sampled) -> None
//       ModelRunner.finish for a step whose rows have not moved and whose tokens are each row's
//       last: token i (int32 or int64) into row rows[i] of `token_ids` at positions[i], of
//       `last_token_ids`, and of the step's output (`sampled`, int32 [num_rows, 1]), whose
//       `num_sampled` entry becomes 1. Every row and position is checked before any write.
//   sha256_extensions() -> bool
//       Whether this CPU has the SHA extensions `block_keys` runs on (x86 SHA-NI).
//   block_keys(parent, token_ids, start, count, block_size) -> list[bytes]
//       core/kv_cache_manager.py's `block_key` chained over `count` blocks of int32 token_ids
//       from `start` on: key i is SHA-256(key i-1 || the block's tokens as bytes), key -1 being
//       `parent`. SHA-256 in the CPU's SHA instructions, without OpenSSL's per-digest setup
//       (~0.8 us a key, where hashlib's with the block's bytes copied takes ~2.5 warm).
//   output_append(slots, tokens, ids, counts, watched, intervals, counts_out, looked_at)
//       -> (num_looked_at, longest)
//       The client's engine/output_token_store.py OutputTokenStore.append_and_look: see there.
//       `counts_out` (int64, len(slots)) receives each slot's new count, `looked_at` (int64, at
//       least len(slots) long) the positions the client looks at; `longest`: the largest count
//       of the slots given, after the append.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define VLLM_LITE_X86 1
#endif
#include <limits>
#include <initializer_list>

namespace {

// A buffer held for one call; released by the destructor.
class Array {
 public:
  ~Array() {
    if (held_) PyBuffer_Release(&view_);
  }

  // `name`: the argument's name in error messages. `dims`: 1 or 2; `itemsizes`: accepted sizes
  // for a `kind` of 'i' (signed integers) or 'b' (bool).
  bool take(PyObject* object, const char* name, int dims, char kind, bool writable, Py_ssize_t itemsize_a,
            Py_ssize_t itemsize_b = 0) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(object, &view_, flags) < 0) {
      PyErr_Format(PyExc_TypeError, "%s: a C-contiguous%s array is needed", name, writable ? " writable" : "");
      return false;
    }
    held_ = true;
    if (view_.ndim != dims) {
      PyErr_Format(PyExc_ValueError, "%s: %d dimension(s) expected, got %d", name, dims, view_.ndim);
      return false;
    }
    if (!kind_matches(kind) || (view_.itemsize != itemsize_a && view_.itemsize != itemsize_b)) {
      PyErr_Format(PyExc_TypeError, "%s: unexpected element type '%s' (%zd bytes)", name, view_.format,
                   view_.itemsize);
      return false;
    }
    return true;
  }

  // (take() has checked the dimensions: a row count for all, columns for the 2-D one.)
  Py_ssize_t size() const { return view_.shape[0]; }
  Py_ssize_t columns() const { return view_.shape[1]; }
  Py_ssize_t itemsize() const { return view_.itemsize; }
  template <typename T>
  T* data() const {
    return static_cast<T*>(view_.buf);
  }

 private:
  bool kind_matches(char kind) const {
    const char* format = view_.format == nullptr ? "B" : view_.format;
    if (*format == '<' || *format == '=' || *format == '@') ++format;
    if (kind == 'b') return std::strcmp(format, "?") == 0;
    return std::strchr("bhilq", *format) != nullptr && format[1] == '\0';
  }

  Py_buffer view_{};
  bool held_ = false;
};

int64_t load_int(const void* data, Py_ssize_t itemsize, Py_ssize_t i) {
  return itemsize == 4 ? static_cast<const int32_t*>(data)[i] : static_cast<const int64_t*>(data)[i];
}

// Every entry of `slots` names a row of `num_slots` (else an IndexError, before any write);
// `what` names an entry in the message (the token stores' slots, the worker batch's rows).
bool slots_in_range(const int64_t* slot, Py_ssize_t n, Py_ssize_t num_slots, const char* function,
                    const char* what = "slot") {
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (slot[i] < 0 || slot[i] >= num_slots) {
      PyErr_Format(PyExc_IndexError, "%s: %s %lld out of range 0..%zd", function, what,
                   static_cast<long long>(slot[i]), num_slots - 1);
      return false;
    }
  }
  return true;
}

bool sizes_are(const char* function, Py_ssize_t size, std::initializer_list<const Array*> arrays) {
  for (const Array* array : arrays) {
    if (array->size() != size) {
      PyErr_Format(PyExc_ValueError, "%s: an array of %zd entries where %zd are needed", function, array->size(),
                   size);
      return false;
    }
  }
  return true;
}

PyObject* store_append(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 11) {
    PyErr_Format(PyExc_TypeError, "store_append takes 11 arguments, got %zd", nargs);
    return nullptr;
  }
  Array slots, tokens, token_ids, tail_ids, num_tokens, look_at_len, min_stop_len, length_limit, each_step, stop_ids,
      looked_at;
  if (!slots.take(args[0], "slots", 1, 'i', false, 8) || !tokens.take(args[1], "tokens", 1, 'i', false, 4, 8) ||
      !token_ids.take(args[2], "token_ids", 2, 'i', true, 4) || !tail_ids.take(args[3], "tail", 2, 'i', true, 4) ||
      !num_tokens.take(args[4], "num_tokens", 1, 'i', true, 8) ||
      !look_at_len.take(args[5], "look_at_len", 1, 'i', true, 8) ||
      !min_stop_len.take(args[6], "min_stop_len", 1, 'i', false, 8) ||
      !length_limit.take(args[7], "length_limit", 1, 'i', false, 8) ||
      !each_step.take(args[8], "each_step", 1, 'b', false, 1) ||
      !stop_ids.take(args[9], "stop_ids", 1, 'i', false, 4) ||
      !looked_at.take(args[10], "looked_at", 1, 'i', true, 8)) {
    return nullptr;
  }
  const Py_ssize_t n = slots.size(), num_slots = token_ids.size(), capacity = token_ids.columns();
  const Py_ssize_t tail_len = tail_ids.columns();
  if (tokens.size() != n || looked_at.size() < n) {
    PyErr_Format(PyExc_ValueError, "store_append: %zd slots, %zd tokens, room for %zd positions", n, tokens.size(),
                 looked_at.size());
    return nullptr;
  }
  if (tail_ids.size() != num_slots || tail_len < 1) {
    PyErr_Format(PyExc_ValueError, "store_append: a %zd x %zd tail for %zd slots", tail_ids.size(), tail_len,
                 num_slots);
    return nullptr;
  }
  // Checked before anything is written: a bad call leaves the store as it was (as numpy's
  // indexing does).
  const int64_t* slot = slots.data<int64_t>();
  if (!sizes_are("store_append", num_slots, {&num_tokens, &look_at_len, &min_stop_len, &length_limit, &each_step}) ||
      !slots_in_range(slot, n, num_slots, "store_append")) {
    return nullptr;
  }
  int64_t* length = num_tokens.data<int64_t>();
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (length[slot[i]] < 0 || length[slot[i]] >= capacity) {
      PyErr_Format(PyExc_IndexError, "store_append: slot %lld holds %lld tokens, room for %zd",
                   static_cast<long long>(slot[i]), static_cast<long long>(length[slot[i]]), capacity);
      return nullptr;
    }
  }
  int32_t* rows = token_ids.data<int32_t>();
  int32_t* tail = tail_ids.data<int32_t>();
  int64_t* look_at = look_at_len.data<int64_t>();
  const int64_t* min_stop = min_stop_len.data<int64_t>();
  const int64_t* limit = length_limit.data<int64_t>();
  const bool* every_token = each_step.data<bool>();
  const int32_t* stop = stop_ids.data<int32_t>();
  const Py_ssize_t num_stop = stop_ids.size();
  int64_t* out = looked_at.data<int64_t>();
  Py_ssize_t count = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    const int64_t s = slot[i];
    if (length[s] >= capacity) {  // (only a slot named twice gets here: never written past its row)
      PyErr_Format(PyExc_IndexError, "store_append: slot %lld named twice, its row full",
                   static_cast<long long>(s));
      return nullptr;
    }
    const int64_t token = load_int(tokens.data<void>(), tokens.itemsize(), i);
    // One contiguous row of tails takes a step's tokens where the rows' next positions lie a
    // row apart each (a cold line per request per step); a row gets a whole line's worth at once.
    int32_t* slot_tail = tail + s * tail_len;
    slot_tail[length[s] % tail_len] = static_cast<int32_t>(token);
    const int64_t now = ++length[s];
    if (now % tail_len == 0) {
      std::memcpy(rows + s * capacity + now - tail_len, slot_tail, tail_len * sizeof(int32_t));
    }
    bool look = now >= look_at[s];
    if (!look && num_stop > 0 && now >= min_stop[s]) {
      for (Py_ssize_t j = 0; j < num_stop && !look; ++j) look = token == stop[j];
    }
    if (look) {
      out[count++] = i;
      look_at[s] = every_token[s] ? 0 : limit[s];
    }
  }
  return PyLong_FromSsize_t(count);
}

PyObject* running_scan(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 10) {
    PyErr_Format(PyExc_TypeError, "running_scan takes 10 arguments, got %zd", nargs);
    return nullptr;
  }
  Array slots, with_placeholders, computed, length_limit, held_blocks, known_out, computed_out, to_allocate,
      new_blocks_out;
  const long long block_size = PyLong_AsLongLong(args[5]);
  if (block_size == -1 && PyErr_Occurred()) return nullptr;
  if (block_size <= 0) {
    PyErr_Format(PyExc_ValueError, "running_scan: block_size must be positive, got %lld", block_size);
    return nullptr;
  }
  if (!slots.take(args[0], "slots", 1, 'i', false, 8) ||
      !with_placeholders.take(args[1], "with_placeholders", 1, 'i', false, 8) ||
      !computed.take(args[2], "computed", 1, 'i', false, 8) ||
      !length_limit.take(args[3], "length_limit", 1, 'i', false, 8) ||
      !held_blocks.take(args[4], "held", 1, 'i', false, 8) || !known_out.take(args[6], "known", 1, 'i', true, 8) ||
      !computed_out.take(args[7], "computed_out", 1, 'i', true, 8) ||
      !to_allocate.take(args[8], "to_allocate", 1, 'i', true, 8) ||
      !new_blocks_out.take(args[9], "new_blocks", 1, 'i', true, 8)) {
    return nullptr;
  }
  const Py_ssize_t n = slots.size(), num_slots = with_placeholders.size();
  if (!sizes_are("running_scan", n, {&held_blocks, &known_out, &computed_out, &to_allocate, &new_blocks_out}) ||
      !sizes_are("running_scan", num_slots, {&computed, &length_limit}) ||
      !slots_in_range(slots.data<int64_t>(), n, num_slots, "running_scan")) {
    return nullptr;
  }
  const int64_t* slot = slots.data<int64_t>();
  const int64_t* placeholders = with_placeholders.data<int64_t>();
  const int64_t* done = computed.data<int64_t>();
  const int64_t* limit = length_limit.data<int64_t>();
  const int64_t* held = held_blocks.data<int64_t>();
  int64_t* known = known_out.data<int64_t>();
  int64_t* done_out = computed_out.data<int64_t>();
  int64_t* allocate = to_allocate.data<int64_t>();
  int64_t* new_blocks = new_blocks_out.data<int64_t>();
  bool every_one = true;
  int64_t total = 0, min_new = std::numeric_limits<int64_t>::max(), total_blocks = 0;
  Py_ssize_t count = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    const int64_t s = slot[i], k = placeholders[s], c = done[s];
    known[i] = k;
    done_out[i] = c;
    if (k >= limit[s]) {  // its tokens in flight end it: not scheduled
      every_one = false;
      continue;
    }
    total += k - c;
    if (k - c < min_new) min_new = k - c;
    const int64_t needed = (k + block_size - 1) / block_size - held[i];
    if (needed > 0) {  // its known tokens outgrow its blocks
      allocate[count] = i;
      new_blocks[count++] = needed;
      total_blocks += needed;
    }
  }
  if (min_new == std::numeric_limits<int64_t>::max()) min_new = 1;  // none scheduled (as the numpy code says)
  return Py_BuildValue("(NLLnL)", PyBool_FromLong(every_one), static_cast<long long>(total),
                       static_cast<long long>(min_new), count, static_cast<long long>(total_blocks));
}

PyObject* running_advance(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_Format(PyExc_TypeError, "running_advance takes 4 arguments, got %zd", nargs);
    return nullptr;
  }
  Array slots, known, computed, with_placeholders;
  if (!slots.take(args[0], "slots", 1, 'i', false, 8) || !known.take(args[1], "known", 1, 'i', false, 8) ||
      !computed.take(args[2], "computed", 1, 'i', true, 8) ||
      !with_placeholders.take(args[3], "with_placeholders", 1, 'i', true, 8)) {
    return nullptr;
  }
  const Py_ssize_t n = slots.size(), num_slots = computed.size();
  if (!sizes_are("running_advance", n, {&known}) || !sizes_are("running_advance", num_slots, {&with_placeholders}) ||
      !slots_in_range(slots.data<int64_t>(), n, num_slots, "running_advance")) {
    return nullptr;
  }
  const int64_t* slot = slots.data<int64_t>();
  const int64_t* k = known.data<int64_t>();
  int64_t* done = computed.data<int64_t>();
  int64_t* placeholders = with_placeholders.data<int64_t>();
  for (Py_ssize_t i = 0; i < n; ++i) {
    done[slot[i]] = k[i];
    placeholders[slot[i]] = k[i] + 1;
  }
  Py_RETURN_NONE;
}

PyObject* decode_inputs(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 9) {
    PyErr_Format(PyExc_TypeError, "decode_inputs takes 9 arguments, got %zd", nargs);
    return nullptr;
  }
  Array num_computed, num_tokens, last_token_ids, block_ids, positions, seq_lens, slot_mapping, input_ids;
  const long long block_size = PyLong_AsLongLong(args[4]);
  if (block_size == -1 && PyErr_Occurred()) return nullptr;
  if (block_size <= 0) {
    PyErr_Format(PyExc_ValueError, "decode_inputs: block_size must be positive, got %lld", block_size);
    return nullptr;
  }
  if (!num_computed.take(args[0], "num_computed", 1, 'i', false, 4) ||
      !num_tokens.take(args[1], "num_tokens", 1, 'i', false, 4) ||
      !last_token_ids.take(args[2], "last_token_ids", 1, 'i', false, 4) ||
      !block_ids.take(args[3], "block_ids", 2, 'i', false, 4) ||
      !positions.take(args[5], "positions", 1, 'i', true, 8) || !seq_lens.take(args[6], "seq_lens", 1, 'i', true, 4) ||
      !slot_mapping.take(args[7], "slot_mapping", 1, 'i', true, 8) ||
      !input_ids.take(args[8], "input_ids", 1, 'i', true, 8)) {
    return nullptr;
  }
  const Py_ssize_t n = positions.size(), width = block_ids.columns();
  if (!sizes_are("decode_inputs", n, {&seq_lens, &slot_mapping, &input_ids})) return nullptr;
  for (const Array* rows : {&num_computed, &num_tokens, &last_token_ids, &block_ids}) {
    if (rows->size() < n) {
      PyErr_Format(PyExc_ValueError, "decode_inputs: %zd rows where %zd are needed", rows->size(), n);
      return nullptr;
    }
  }
  const int32_t* computed = num_computed.data<int32_t>();
  const int32_t* known = num_tokens.data<int32_t>();
  const int32_t* last = last_token_ids.data<int32_t>();
  const int32_t* blocks = block_ids.data<int32_t>();
  int64_t* position = positions.data<int64_t>();
  int32_t* seq_len = seq_lens.data<int32_t>();
  int64_t* slot = slot_mapping.data<int64_t>();
  int64_t* input = input_ids.data<int64_t>();
  int64_t longest = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    const int64_t c = computed[i];
    if (c < 0 || c + 1 != known[i]) return PyLong_FromLong(-1);
    const int64_t block = c / block_size;
    if (block >= width) {
      PyErr_Format(PyExc_IndexError, "decode_inputs: row %zd at position %lld needs block %lld, past its %zd columns", i,
                   static_cast<long long>(c), static_cast<long long>(block), width);
      return nullptr;
    }
    position[i] = c;
    seq_len[i] = static_cast<int32_t>(c + 1);
    slot[i] = static_cast<int64_t>(blocks[i * width + block]) * block_size + c % block_size;
    input[i] = last[i];
    if (c + 1 > longest) longest = c + 1;
  }
  return PyLong_FromLongLong(longest);
}

PyObject* copy_block_rows(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_Format(PyExc_TypeError, "copy_block_rows takes 2 arguments, got %zd", nargs);
    return nullptr;
  }
  Array block_ids, block_table;
  if (!block_ids.take(args[0], "block_ids", 2, 'i', false, 4) ||
      !block_table.take(args[1], "block_table", 2, 'i', true, 4)) {
    return nullptr;
  }
  const Py_ssize_t rows = block_table.size(), width = block_table.columns(), stride = block_ids.columns();
  if (rows > block_ids.size() || width > stride) {
    PyErr_Format(PyExc_ValueError, "copy_block_rows: a %zd x %zd table from %zd x %zd block ids", rows, width,
                 block_ids.size(), stride);
    return nullptr;
  }
  const int32_t* from = block_ids.data<int32_t>();
  int32_t* to = block_table.data<int32_t>();
  for (Py_ssize_t i = 0; i < rows; ++i) std::memcpy(to + i * width, from + i * stride, width * sizeof(int32_t));
  Py_RETURN_NONE;
}

// ---- SHA-256 (FIPS 180-4) in the x86 SHA extensions ----

constexpr uint32_t kSha256Init[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                     0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
alignas(16) constexpr uint32_t kSha256Rounds[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

bool cpuid_says_sha_extensions() {
#ifdef VLLM_LITE_X86
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool sha = (b >> 29) & 1;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  const bool ssse3 = (c >> 9) & 1, sse41 = (c >> 19) & 1;
  return sha && ssse3 && sse41;
#else
  return false;
#endif
}

// Asked once: CPUID traps to the hypervisor in a VM (microseconds a call).
bool cpu_has_sha_extensions() {
  static const bool has = cpuid_says_sha_extensions();
  return has;
}

#ifdef VLLM_LITE_X86
// The compression function over `num_blocks` 64-byte blocks of `data`. The state is kept as the
// instructions want it: ABEF and CDGH; message words are big-endian, hence the byte shuffle.
__attribute__((target("sha,sse4.1,ssse3"))) void sha256_blocks(uint32_t state[8], const uint8_t* data,
                                                                size_t num_blocks) {
  const __m128i byte_swap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
  __m128i dcba = _mm_shuffle_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(state)), 0xB1);
  __m128i hgfe = _mm_shuffle_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(state + 4)), 0x1B);
  __m128i abef = _mm_alignr_epi8(dcba, hgfe, 8);
  __m128i cdgh = _mm_blend_epi16(hgfe, dcba, 0xF0);
  for (size_t block = 0; block < num_blocks; ++block, data += 64) {
    const __m128i abef_before = abef, cdgh_before = cdgh;
    // w[g % 4]: the message words of rounds 4g..4g+3. Words 16 on are made as in FIPS 180-4's
    // schedule: sha256msg1 over groups g-1 and g (in group g), then sha256msg2 with groups g and
    // g-1 (in group g, for group g+1), before group g-1's words are overwritten.
    __m128i w[4];
    for (int g = 0; g < 16; ++g) {
      if (g < 4) {
        w[g] = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(data + 16 * g)), byte_swap);
      }
      const __m128i words = w[g % 4];
      __m128i message =
          _mm_add_epi32(words, _mm_load_si128(reinterpret_cast<const __m128i*>(kSha256Rounds + 4 * g)));
      cdgh = _mm_sha256rnds2_epu32(cdgh, abef, message);
      message = _mm_shuffle_epi32(message, 0x0E);
      abef = _mm_sha256rnds2_epu32(abef, cdgh, message);
      if (g >= 3 && g <= 14) {
        __m128i& next = w[(g + 1) % 4];
        next = _mm_sha256msg2_epu32(_mm_add_epi32(next, _mm_alignr_epi8(words, w[(g + 3) % 4], 4)), words);
      }
      if (g >= 1 && g <= 12) w[(g + 3) % 4] = _mm_sha256msg1_epu32(w[(g + 3) % 4], words);
    }
    abef = _mm_add_epi32(abef, abef_before);
    cdgh = _mm_add_epi32(cdgh, cdgh_before);
  }
  const __m128i feba = _mm_shuffle_epi32(abef, 0x1B);
  const __m128i dchg = _mm_shuffle_epi32(cdgh, 0xB1);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(state), _mm_blend_epi16(feba, dchg, 0xF0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(state + 4), _mm_alignr_epi8(dchg, feba, 8));
}
#endif

// SHA-256 of `size` bytes at `message` into `out`; `padded`: 128 bytes of scratch for the padded
// tail (one or two blocks). Only where cpu_has_sha_extensions() (the callers ask first).
void sha256(const uint8_t* message, size_t size, uint8_t* padded, uint8_t out[32]) {
  uint32_t state[8];
  std::memcpy(state, kSha256Init, sizeof(state));
  const size_t whole = size / 64, tail = size % 64;
  const size_t tail_blocks = tail + 9 <= 64 ? 1 : 2;
  std::memcpy(padded, message + 64 * whole, tail);
  padded[tail] = 0x80;
  std::memset(padded + tail + 1, 0, 64 * tail_blocks - tail - 1 - 8);
  const uint64_t bits = static_cast<uint64_t>(size) * 8;
  for (int i = 0; i < 8; ++i) padded[64 * tail_blocks - 1 - i] = static_cast<uint8_t>(bits >> (8 * i));
#ifdef VLLM_LITE_X86
  sha256_blocks(state, message, whole);
  sha256_blocks(state, padded, tail_blocks);
#endif
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 4; ++j) out[4 * i + j] = static_cast<uint8_t>(state[i] >> (24 - 8 * j));
  }
}

PyObject* sha256_extensions(PyObject*, PyObject*) { return PyBool_FromLong(cpu_has_sha_extensions()); }

PyObject* block_keys(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_Format(PyExc_TypeError, "block_keys takes 5 arguments, got %zd", nargs);
    return nullptr;
  }
  if (!cpu_has_sha_extensions()) {
    PyErr_SetString(PyExc_RuntimeError, "block_keys: this CPU has no SHA extensions");
    return nullptr;
  }
  char* parent = nullptr;
  Py_ssize_t parent_size = 0;
  if (PyBytes_AsStringAndSize(args[0], &parent, &parent_size) < 0) return nullptr;
  Array tokens;
  if (!tokens.take(args[1], "token_ids", 1, 'i', false, 4)) return nullptr;
  const Py_ssize_t start = PyLong_AsSsize_t(args[2]), count = PyLong_AsSsize_t(args[3]),
                   block_size = PyLong_AsSsize_t(args[4]);
  if (PyErr_Occurred()) return nullptr;
  if (parent_size != 32 || start < 0 || count < 0 || block_size <= 0 || start + count * block_size > tokens.size()) {
    PyErr_Format(PyExc_ValueError,
                 "block_keys: a 32-byte parent and %zd blocks of %zd tokens from %zd within %zd tokens are needed "
                 "(parent of %zd bytes)",
                 count, block_size, start, tokens.size(), parent_size);
    return nullptr;
  }
  const size_t token_bytes = static_cast<size_t>(block_size) * sizeof(int32_t);
  std::vector<uint8_t> message(32 + token_bytes), padded(64 * 2);
  std::memcpy(message.data(), parent, 32);
  PyObject* keys = PyList_New(count);
  if (keys == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < count; ++i) {
    std::memcpy(message.data() + 32, tokens.data<int32_t>() + start + i * block_size, token_bytes);
    PyObject* key = PyBytes_FromStringAndSize(nullptr, 32);
    if (key == nullptr) {
      Py_DECREF(keys);
      return nullptr;
    }
    uint8_t* digest = reinterpret_cast<uint8_t*>(PyBytes_AS_STRING(key));
    sha256(message.data(), message.size(), padded.data(), digest);
    PyList_SET_ITEM(keys, i, key);
    std::memcpy(message.data(), digest, 32);  // the next block's parent
  }
  return keys;
}

PyObject* output_append(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 8) {
    PyErr_Format(PyExc_TypeError, "output_append takes 8 arguments, got %zd", nargs);
    return nullptr;
  }
  Array slots, tokens, ids, counts, watched, intervals, counts_out, looked_at;
  if (!slots.take(args[0], "slots", 1, 'i', false, 8) || !tokens.take(args[1], "tokens", 1, 'i', false, 4, 8) ||
      !ids.take(args[2], "ids", 2, 'i', true, 4) || !counts.take(args[3], "counts", 1, 'i', true, 8) ||
      !watched.take(args[4], "watched", 1, 'b', false, 1) || !intervals.take(args[5], "intervals", 1, 'i', false, 8) ||
      !counts_out.take(args[6], "counts_out", 1, 'i', true, 8) ||
      !looked_at.take(args[7], "looked_at", 1, 'i', true, 8)) {
    return nullptr;
  }
  const Py_ssize_t n = slots.size(), num_slots = ids.size(), width = ids.columns();
  if (tokens.size() != n || counts_out.size() != n || looked_at.size() < n) {
    PyErr_Format(PyExc_ValueError, "output_append: %zd slots, %zd tokens, %zd counts out, room for %zd positions", n,
                 tokens.size(), counts_out.size(), looked_at.size());
    return nullptr;
  }
  const int64_t* slot = slots.data<int64_t>();
  if (!sizes_are("output_append", num_slots, {&counts, &watched, &intervals}) ||
      !slots_in_range(slot, n, num_slots, "output_append")) {
    return nullptr;
  }
  int64_t* count = counts.data<int64_t>();
  for (Py_ssize_t i = 0; i < n; ++i) {  // (checked before anything is written)
    if (count[slot[i]] < 0 || count[slot[i]] >= width) {
      PyErr_Format(PyExc_IndexError, "output_append: slot %lld holds %lld tokens, room for %zd",
                   static_cast<long long>(slot[i]), static_cast<long long>(count[slot[i]]), width);
      return nullptr;
    }
  }
  int32_t* rows = ids.data<int32_t>();
  const bool* every_token = watched.data<bool>();
  const int64_t* interval = intervals.data<int64_t>();
  int64_t* now_out = counts_out.data<int64_t>();
  int64_t* out = looked_at.data<int64_t>();
  Py_ssize_t num_looked_at = 0;
  int64_t longest = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    const int64_t s = slot[i];
    if (count[s] >= width) {  // (only a slot named twice gets here: never written past its row)
      PyErr_Format(PyExc_IndexError, "output_append: slot %lld named twice, its row full", static_cast<long long>(s));
      return nullptr;
    }
    rows[s * width + count[s]] = static_cast<int32_t>(load_int(tokens.data<void>(), tokens.itemsize(), i));
    const int64_t now = ++count[s];
    now_out[i] = now;
    if (now > longest) longest = now;
    if (every_token[s] || now == 1 || (interval[s] > 0 && (now - 1) % interval[s] == 0)) out[num_looked_at++] = i;
  }
  return Py_BuildValue("(nL)", num_looked_at, static_cast<long long>(longest));
}

PyObject* block_rows_append(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_Format(PyExc_TypeError, "block_rows_append takes 5 arguments, got %zd", nargs);
    return nullptr;
  }
  Array rows, counts, new_block_ids, block_ids, num_blocks;
  if (!rows.take(args[0], "rows", 1, 'i', false, 8) || !counts.take(args[1], "counts", 1, 'i', false, 4) ||
      !new_block_ids.take(args[2], "new_block_ids", 1, 'i', false, 4) ||
      !block_ids.take(args[3], "block_ids", 2, 'i', true, 4) ||
      !num_blocks.take(args[4], "num_blocks", 1, 'i', true, 4)) {
    return nullptr;
  }
  const Py_ssize_t n = rows.size(), num_rows = block_ids.size(), width = block_ids.columns();
  const int64_t* row = rows.data<int64_t>();
  const int32_t* count = counts.data<int32_t>();
  int32_t* held = num_blocks.data<int32_t>();
  if (!sizes_are("block_rows_append", n, {&counts}) || !sizes_are("block_rows_append", num_rows, {&num_blocks}) ||
      !slots_in_range(row, n, num_rows, "block_rows_append", "row")) {
    return nullptr;
  }
  Py_ssize_t total = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (count[i] < 0) {
      PyErr_Format(PyExc_ValueError, "block_rows_append: row %lld takes %d blocks", static_cast<long long>(row[i]),
                   count[i]);
      return nullptr;
    }
    if (held[row[i]] + static_cast<int64_t>(count[i]) > width) {
      PyErr_Format(PyExc_ValueError, "row %lld holds %d blocks: more exceed its %zd", static_cast<long long>(row[i]),
                   held[row[i]], width);
      return nullptr;
    }
    total += count[i];
  }
  if (total != new_block_ids.size()) {
    PyErr_Format(PyExc_ValueError, "block_rows_append: the counts take %zd blocks, %zd given", total,
                 new_block_ids.size());
    return nullptr;
  }
  const int32_t* source = new_block_ids.data<int32_t>();
  int32_t* table = block_ids.data<int32_t>();
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (count[i] == 0) continue;
    if (held[row[i]] + static_cast<int64_t>(count[i]) > width) {  // (only a row named twice gets here)
      PyErr_Format(PyExc_IndexError, "block_rows_append: row %lld named twice, its row full",
                   static_cast<long long>(row[i]));
      return nullptr;
    }
    std::memcpy(table + row[i] * width + held[row[i]], source, count[i] * sizeof(int32_t));
    source += count[i];
    held[row[i]] += count[i];
  }
  Py_RETURN_NONE;
}

PyObject* sampled_count(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_Format(PyExc_TypeError, "sampled_count takes 5 arguments, got %zd", nargs);
    return nullptr;
  }
  Array rows, num_tokens, row_serial, positions, serials;
  if (!rows.take(args[0], "rows", 1, 'i', false, 8) || !num_tokens.take(args[1], "num_tokens", 1, 'i', true, 4) ||
      !row_serial.take(args[2], "row_serial", 1, 'i', false, 8) ||
      !positions.take(args[3], "positions", 1, 'i', true, 4) || !serials.take(args[4], "serials", 1, 'i', true, 8)) {
    return nullptr;
  }
  const Py_ssize_t n = rows.size(), num_rows = num_tokens.size();
  const int64_t* row = rows.data<int64_t>();
  if (!sizes_are("sampled_count", n, {&positions, &serials}) ||
      !sizes_are("sampled_count", num_rows, {&row_serial}) ||
      !slots_in_range(row, n, num_rows, "sampled_count", "row")) {
    return nullptr;
  }
  int32_t* count = num_tokens.data<int32_t>();
  const int64_t* serial = row_serial.data<int64_t>();
  int32_t* position = positions.data<int32_t>();
  int64_t* serial_out = serials.data<int64_t>();
  for (Py_ssize_t i = 0; i < n; ++i) {
    const int64_t r = row[i];
    position[i] = count[r]++;
    serial_out[i] = serial[r];
  }
  Py_RETURN_NONE;
}

PyObject* sampled_write(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 7) {
    PyErr_Format(PyExc_TypeError, "sampled_write takes 7 arguments, got %zd", nargs);
    return nullptr;
  }
  Array rows, positions, tokens, token_ids, last_token_ids, sampled, num_sampled;
  if (!rows.take(args[0], "rows", 1, 'i', false, 8) || !positions.take(args[1], "positions", 1, 'i', false, 4) ||
      !tokens.take(args[2], "tokens", 1, 'i', false, 4, 8) || !token_ids.take(args[3], "token_ids", 2, 'i', true, 4) ||
      !last_token_ids.take(args[4], "last_token_ids", 1, 'i', true, 4) ||
      !sampled.take(args[5], "sampled", 2, 'i', true, 4) ||
      !num_sampled.take(args[6], "num_sampled", 1, 'i', true, 4)) {
    return nullptr;
  }
  const Py_ssize_t n = rows.size(), width = token_ids.columns(), num_out = num_sampled.size();
  const int64_t* row = rows.data<int64_t>();
  const int32_t* position = positions.data<int32_t>();
  if (!sizes_are("sampled_write", n, {&positions, &tokens}) ||
      !sizes_are("sampled_write", token_ids.size(), {&last_token_ids}) ||
      !sizes_are("sampled_write", num_out, {&sampled}) ||
      !slots_in_range(row, n, std::min(num_out, token_ids.size()), "sampled_write", "row")) {
    return nullptr;
  }
  if (sampled.columns() != 1) {
    PyErr_Format(PyExc_ValueError, "sampled_write: sampled has %zd columns, 1 expected", sampled.columns());
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (position[i] < 0 || position[i] >= width) {
      PyErr_Format(PyExc_IndexError, "sampled_write: row %lld position %d out of range 0..%zd",
                   static_cast<long long>(row[i]), position[i], width - 1);
      return nullptr;
    }
  }
  int32_t* history = token_ids.data<int32_t>();
  int32_t* last = last_token_ids.data<int32_t>();
  int32_t* out = sampled.data<int32_t>();
  int32_t* counted = num_sampled.data<int32_t>();
  for (Py_ssize_t i = 0; i < n; ++i) {
    const int64_t r = row[i];
    const int32_t token = static_cast<int32_t>(load_int(tokens.data<void>(), tokens.itemsize(), i));
    history[r * width + position[i]] = token;
    last[r] = token;
    out[r] = token;
    counted[r] = 1;
  }
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"store_append", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(store_append)), METH_FASTCALL,
     "TokenStore.append's loop (core/token_store.py)."},
    {"running_scan", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(running_scan)), METH_FASTCALL,
     "TokenStore.scan_running's loop (core/token_store.py)."},
    {"running_advance", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(running_advance)),
     METH_FASTCALL, "TokenStore.advance_running's loop (core/token_store.py)."},
    {"decode_inputs", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(decode_inputs)), METH_FASTCALL,
     "A decode step's worker inputs (worker/model_runner.py)."},
    {"copy_block_rows", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(copy_block_rows)),
     METH_FASTCALL, "A decode step's block table (worker/model_runner.py)."},
    {"block_rows_append", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(block_rows_append)),
     METH_FASTCALL, "BlockTable.append_rows's loop (worker/block_table.py)."},
    {"sampled_count", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(sampled_count)), METH_FASTCALL,
     "A step's sampled rows counted (worker/model_runner.py)."},
    {"sampled_write", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(sampled_write)), METH_FASTCALL,
     "A finished step's tokens into the batch and its output (worker/model_runner.py)."},
    {"sha256_extensions", sha256_extensions, METH_NOARGS, "Whether block_keys can run on this CPU."},
    {"block_keys", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(block_keys)), METH_FASTCALL,
     "KVCacheManager's chained prefix-cache keys (core/kv_cache_manager.py)."},
    {"output_append", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(output_append)), METH_FASTCALL,
     "OutputTokenStore.append_and_look's loop (engine/output_token_store.py)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "vllm_lite._bookkeeping", nullptr, -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__bookkeeping(void) { return PyModule_Create(&kModule); }
