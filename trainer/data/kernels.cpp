// The readers' work at C speed (trainer/data/kernels.py says why): text parsed into flat columns in parallel, and
// the array steps every reader takes next (contiguous codes, rows grouped by owner, TiSASRec's rescaled times).
//
// parse_file(path, kinds, delimiter, skip_lines, chunk_bytes) -> (columns, reason)
//   kinds: one letter per field of every row: 'i' an int64 (optional sign, at most 18 digits), 'f' a double
//   ('nan' and 'inf' included: the caller checks them), 'F' a finite number, checked and not kept, '-' a field
//   read past (any text). columns: one tensor per 'i'/'f' field, in order (int64 / float64). delimiter: "" for runs of blanks (spaces, tabs), else the exact
//   text between fields (",", "::"), blanks around a field ignored. A leading UTF-8 BOM is dropped, blank lines
//   are skipped, a '\r' before a line's end is ignored. Anything else (another field count, a field that is not
//   of its kind, a quote, a NUL) refuses the whole file: columns is empty and reason says the first refusal's
//   row-free cause; the caller's slower parsers then read (or name the line of) what this one would not.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace {

struct Blanks {
  bool is[256] = {};
  Blanks() { for (unsigned char c : {' ', '\t', '\r', '\v', '\f'}) is[c] = true; }
};
const Blanks kBlanks;
inline bool blank(char c) { return kBlanks.is[static_cast<unsigned char>(c)]; }

struct Piece {                                   // one thread's rows of one chunk
  std::vector<std::vector<int64_t>> ints;
  std::vector<std::vector<double>> floats;
  std::string refusal;
};

struct Spec {
  std::string kinds, delimiter;
  std::vector<int> slot;                        // the column index of each field among its kind ('-': -1)
  int n_int = 0, n_float = 0;
};

// One field's text [b, e) into its column; false (and why) where it is not of its kind.
inline bool take(const char* b, const char* e, char kind, int slot, Piece& out) {
  if (kind == '-') {
    if (memchr(b, '"', e - b) || memchr(b, '\0', e - b)) { out.refusal = "a quote or NUL byte"; return false; }
    return true;
  }
  if (b == e) { out.refusal = "an empty field"; return false; }
  if (kind == 'i') {
    bool neg = false;
    if (*b == '-' || *b == '+') { neg = *b == '-'; ++b; }
    if (b == e || e - b > 18) { out.refusal = "an integer field of no or more than 18 digits"; return false; }
    int64_t v = 0;
    for (const char* p = b; p < e; ++p) {
      unsigned d = static_cast<unsigned char>(*p) - '0';
      if (d > 9) { out.refusal = "a field that is not an integer"; return false; }
      v = v * 10 + d;
    }
    out.ints[slot].push_back(neg ? -v : v);
    return true;
  }
  if (*b == '+') ++b;
  double v;
  auto r = std::from_chars(b, e, v);
  if (r.ec != std::errc() || r.ptr != e) { out.refusal = "a field that is not a number"; return false; }
  if (kind == 'F') {                          // checked, not kept (u.data's rating: read past, but never a NaN)
    if (!std::isfinite(v)) { out.refusal = "a number that is not finite"; return false; }
    return true;
  }
  out.floats[slot].push_back(v);
  return true;
}

// Rows of [p, end): every line ends before `end` or at it.
bool parse_rows(const char* p, const char* end, const Spec& spec, Piece& out) {
  const size_t nf = spec.kinds.size(), dl = spec.delimiter.size();
  const char* d = spec.delimiter.data();
  while (p < end) {
    const char* line_end = static_cast<const char*>(memchr(p, '\n', end - p));
    if (!line_end) line_end = end;
    const char* q = p;
    while (q < line_end && blank(*q)) ++q;
    if (q == line_end) { p = line_end + 1; continue; }        // a blank line
    for (size_t f = 0; f < nf; ++f) {
      const char* fe;
      if (dl == 0) {
        if (f > 0) {
          if (q == line_end || !blank(*q)) { out.refusal = "fewer fields than the first row"; return false; }
          while (q < line_end && blank(*q)) ++q;
        }
        fe = q;
        while (fe < line_end && !blank(*fe)) ++fe;
        if (fe == q) { out.refusal = "fewer fields than the first row"; return false; }
        if (!take(q, fe, spec.kinds[f], spec.slot[f], out)) return false;
        q = fe;
      } else {
        if (f > 0) {
          if (static_cast<size_t>(line_end - q) < dl || memcmp(q, d, dl) != 0) {
            out.refusal = "fewer fields than the first row";
            return false;
          }
          q += dl;
        }
        while (q < line_end && blank(*q)) ++q;
        fe = q;
        while (fe < line_end && !(static_cast<size_t>(line_end - fe) >= dl && memcmp(fe, d, dl) == 0)) ++fe;
        const char* te = fe;                                   // the field without its trailing blanks
        while (te > q && blank(te[-1])) --te;
        if (!take(q, te, spec.kinds[f], spec.slot[f], out)) return false;
        q = fe;
      }
    }
    while (q < line_end && blank(*q)) ++q;
    if (q != line_end) { out.refusal = "more fields than the first row"; return false; }
    p = line_end + 1;
  }
  return true;
}

template <typename T>
torch::Tensor to_tensor(std::vector<T>&& v, torch::ScalarType type) {
  auto* held = new std::vector<T>(std::move(v));
  const int64_t n = static_cast<int64_t>(held->size());
  return torch::from_blob(held->data(), {n}, [held](void*) { delete held; }, torch::TensorOptions().dtype(type));
}

using Result = std::tuple<std::vector<torch::Tensor>, std::string>;
Result refuse(const std::string& why) { return Result(std::vector<torch::Tensor>{}, why); }

}  // namespace

Result parse_file(const std::string& path, const std::string& kinds, const std::string& delimiter, int64_t skip_lines,
                  int64_t chunk_bytes) {
  Spec spec{kinds, delimiter, {}, 0, 0};
  for (char k : kinds) spec.slot.push_back(k == 'i' ? spec.n_int++ : k == 'f' ? spec.n_float++ : -1);
  std::unique_ptr<FILE, int (*)(FILE*)> fh(fopen(path.c_str(), "rb"), fclose);
  if (!fh) return refuse("cannot open the file");
  fseek(fh.get(), 0, SEEK_END);
  const long file_size = ftell(fh.get());
  fseek(fh.get(), 0, SEEK_SET);

  Piece all;
  all.ints.resize(spec.n_int);
  all.floats.resize(spec.n_float);
  std::vector<char> buf;
  size_t carried = 0, consumed = 0;               // bytes of an unfinished line kept from the last chunk; bytes read
  bool first = true, reserved = false;
  int64_t to_skip = skip_lines;
  const int threads = std::max(1, at::get_num_threads());
  for (;;) {
    buf.resize(carried + chunk_bytes);
    const size_t got = fread(buf.data() + carried, 1, chunk_bytes, fh.get());
    const bool last = got < static_cast<size_t>(chunk_bytes);
    size_t n = carried + got, begin = 0;
    consumed += got;
    if (first && n >= 3 && memcmp(buf.data(), "\xef\xbb\xbf", 3) == 0) begin = 3;
    first = false;
    for (; to_skip > 0 && begin < n; --to_skip) {          // header lines
      const char* nl = static_cast<const char*>(memchr(buf.data() + begin, '\n', n - begin));
      if (!nl) break;
      begin = nl - buf.data() + 1;
    }
    size_t stop = n;                                     // parse up to the chunk's last line end
    if (!last) {
      const char* p = buf.data() + n;
      while (p > buf.data() + begin && p[-1] != '\n') --p;
      stop = p - buf.data();
      if (stop == begin && got > 0) return refuse("a line longer than a chunk");
    }
    // cut [begin, stop) into one piece per thread at line ends
    std::vector<size_t> cuts{begin};
    for (int t = 1; t < threads; ++t) {
      size_t at = begin + (stop - begin) * t / threads;
      if (at <= cuts.back()) continue;
      const char* nl = static_cast<const char*>(memchr(buf.data() + at, '\n', stop - at));
      at = nl ? nl - buf.data() + 1 : stop;
      if (at > cuts.back() && at < stop) cuts.push_back(at);
    }
    cuts.push_back(stop);
    std::vector<Piece> pieces(cuts.size() - 1);
    at::parallel_for(0, static_cast<int64_t>(pieces.size()), 1, [&](int64_t lo, int64_t hi) {
      for (int64_t k = lo; k < hi; ++k) {
        Piece& piece = pieces[k];
        piece.ints.resize(spec.n_int);
        piece.floats.resize(spec.n_float);
        const size_t most = (cuts[k + 1] - cuts[k]) / (2 * spec.kinds.size()) + 1;   // rows of the shortest lines
        for (auto& c : piece.ints) c.reserve(most);        // address space only: untouched pages cost nothing
        for (auto& c : piece.floats) c.reserve(most);
        parse_rows(buf.data() + cuts[k], buf.data() + cuts[k + 1], spec, piece);
      }
    });
    size_t chunk_rows = 0;
    for (auto& piece : pieces) {
      if (!piece.refusal.empty()) return refuse(piece.refusal);
      chunk_rows += spec.n_int ? piece.ints[0].size() : spec.n_float ? piece.floats[0].size() : 0;
    }
    if (!reserved && chunk_rows && !last) {
      // reserve what the whole file will need, judged from its first chunk: no doubling of 20M-row columns
      const double rows = double(chunk_rows) * double(file_size) / double(stop - begin) * 1.05 + 1024;
      for (auto& c : all.ints) c.reserve(static_cast<size_t>(rows));
      for (auto& c : all.floats) c.reserve(static_cast<size_t>(rows));
      reserved = true;
    }
    for (auto& piece : pieces) {
      for (int c = 0; c < spec.n_int; ++c) all.ints[c].insert(all.ints[c].end(), piece.ints[c].begin(), piece.ints[c].end());
      for (int c = 0; c < spec.n_float; ++c)
        all.floats[c].insert(all.floats[c].end(), piece.floats[c].begin(), piece.floats[c].end());
    }
    if (last) break;
    carried = n - stop;
    memmove(buf.data(), buf.data() + stop, carried);
  }
  if (ferror(fh.get())) return refuse("a read error");
  std::vector<torch::Tensor> out;
  int ii = 0, fi = 0;
  for (char k : kinds) {
    if (k == 'i') out.push_back(to_tensor(std::move(all.ints[ii++]), torch::kLong));
    else if (k == 'f') out.push_back(to_tensor(std::move(all.floats[fi++]), torch::kDouble));
  }
  return Result(out, "");
}

// codes[r] = the rank of keys[r] among the distinct keys (0..K-1, numeric order); keys in [0, hi].
std::tuple<torch::Tensor, int64_t> dense_codes(torch::Tensor keys, int64_t hi) {
  const int64_t n = keys.numel();
  const int64_t* k = keys.data_ptr<int64_t>();
  std::vector<int64_t> table(hi + 1, 0);
  for (int64_t r = 0; r < n; ++r) table[k[r]] = 1;
  int64_t next = 0;
  for (auto& t : table) { const int64_t seen = t; t = next; next += seen; }
  auto out = torch::empty({n}, torch::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, n, 1 << 16, [&](int64_t lo, int64_t up) {
    for (int64_t r = lo; r < up; ++r) o[r] = table[k[r]];
  });
  return {out, next};
}

// The rows in order of (major, minor), ties in row order; major are codes 0..groups-1. A counting sort by major,
// then each group sorted by minor (mostly sorted already: a file is usually written user by user, in time order).
torch::Tensor group_order(torch::Tensor major, int64_t groups, torch::Tensor minor) {
  const int64_t n = major.numel();
  const int64_t* g = major.data_ptr<int64_t>();
  const int64_t* m = minor.data_ptr<int64_t>();
  std::vector<int64_t> start(groups + 1, 0);
  for (int64_t r = 0; r < n; ++r) ++start[g[r] + 1];
  for (int64_t u = 0; u < groups; ++u) start[u + 1] += start[u];
  auto out = torch::empty({n}, torch::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  {
    std::vector<int64_t> at(start.begin(), start.end() - 1);
    for (int64_t r = 0; r < n; ++r) o[at[g[r]]++] = r;
  }
  at::parallel_for(0, groups, 256, [&](int64_t lo, int64_t up) {
    for (int64_t u = lo; u < up; ++u) {
      int64_t* b = o + start[u];
      int64_t* e = o + start[u + 1];
      bool sorted = true;
      for (int64_t* p = b + 1; p < e && sorted; ++p) sorted = m[p[-1]] <= m[*p];
      if (!sorted) std::stable_sort(b, e, [m](int64_t x, int64_t y) { return m[x] < m[y]; });
    }
  });
  return out;
}

// TiSASRec's per-user time: (t - t_first) / the user's smallest non-zero gap (1 if none), rounded half to even
// (as numpy's round), + 1. times sorted within each user, users cut at offsets.
torch::Tensor rescale_times(torch::Tensor times, torch::Tensor offsets) {
  const int64_t* t = times.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t users = offsets.numel() - 1;
  auto out = torch::empty_like(times);
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, users, 256, [&](int64_t lo, int64_t up) {
    for (int64_t u = lo; u < up; ++u) {
      const int64_t b = off[u], e = off[u + 1];
      if (b == e) continue;
      int64_t scale = INT64_MAX;
      for (int64_t j = b + 1; j < e; ++j) {
        const int64_t gap = t[j] - t[j - 1];
        if (gap != 0 && gap < scale) scale = gap;
      }
      if (scale == INT64_MAX || scale == 1) {
        for (int64_t j = b; j < e; ++j) o[j] = t[j] - t[b] + 1;
      } else {
        const double s = static_cast<double>(scale);
        for (int64_t j = b; j < e; ++j) o[j] = static_cast<int64_t>(std::nearbyint(static_cast<double>(t[j] - t[b]) / s)) + 1;
      }
    }
  });
  return out;
}

// tied[j]: rows order[j] and order[j + 1] share their key (a, b): one pass, without gathering two sorted copies.
torch::Tensor tied_neighbours(torch::Tensor a, torch::Tensor b, torch::Tensor order) {
  const int64_t n = order.numel();
  const int64_t* x = a.data_ptr<int64_t>();
  const int64_t* y = b.data_ptr<int64_t>();
  const int64_t* o = order.data_ptr<int64_t>();
  auto out = torch::empty({std::max<int64_t>(n - 1, 0)}, torch::kBool);
  bool* t = out.data_ptr<bool>();
  at::parallel_for(0, n - 1, 1 << 16, [&](int64_t lo, int64_t up) {
    for (int64_t j = lo; j < up; ++j) t[j] = x[o[j]] == x[o[j + 1]] && y[o[j]] == y[o[j + 1]];
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tied_neighbours", &tied_neighbours, "whether each row of an order shares its key with the next");
  m.def("dense_codes", &dense_codes, "the rank of each key among the distinct keys (keys in [0, hi])");
  m.def("group_order", &group_order, "a stable order of the rows by (major code, minor)");
  m.def("rescale_times", &rescale_times, "TiSASRec's rescaled times of every user");
  m.def("parse_file", &parse_file, "delimited numbers of a text file into flat columns (empty and why: refused)");
}
