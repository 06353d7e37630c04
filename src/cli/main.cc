// linattn command-line program: `linattn demo` (the main job) and `linattn bench`.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "accuracy.h"
#include "harness.h"
#include "linattn/linattn.h"
#include "methods.h"
#include "torch_compare.h"

namespace {

using linattn::bench::Method;
using linattn::bench::Problem;

const char* kUsage =
    "usage: linattn <command> [options]\n"
    "  demo    one row per method on B=1, H=8, n=4096, d=64 (float32): time, GFLOP/s,\n"
    "          peak extra memory, error against the float64 exact reference\n"
    "  bench   forward and forward+backward over a sweep of n, against the BLAS's GEMM rate\n"
    "          --n 1024,2048,...   sequence lengths (default 512..65536, doubling)\n"
    "          --batch B --heads H --head-dim D   (default 1, 8, 64)\n"
    "          --threads T         (default: all cores)\n"
    "          --m M --landmarks L --s-proj S   FAVOR+ features, Nyström landmarks, Linformer\n"
    "                              projection rows (default 256, 64, 256)\n"
    "          --methods A,B,...   only methods whose name contains one of these substrings\n"
    "                              (\"recurrent\": decoding only)\n"
    "          --exact-max-n N     skip exact softmax above this n (default 16384: it is O(n^2))\n"
    "          --forward-only      skip forward+backward\n"
    "          --csv FILE          also write the table as CSV\n"
    "          --plots DIR         write the CSV and PNG plots (time, memory vs n) into DIR\n"
    "          --no-torch          skip the peers (torch sdpa, performer-pytorch, ...; default: on\n"
    "                              when LINATTN_PYTHON, else python3, imports torch)\n"
    "  accuracy  errors of every method against exact attention (float64) over seeds, the\n"
    "          random-feature kernel study, rank and concentration of the attention matrices\n"
    "          --out DIR           CSV files and PNG plots (default out/accuracy)\n"
    "          --seeds S --n N --heads H --head-dim D   (default 5, 1024, 4, 64)\n";

[[noreturn]] void usage_error(const std::string& msg) {
  std::fprintf(stderr, "linattn: %s (linattn --help lists the options)\n", msg.c_str());
  std::exit(2);
}

int64_t parse_int(const std::string& flag, const std::string& s) {
  try {
    size_t pos = 0;
    const long long v = std::stoll(s, &pos);
    if (pos != s.size() || v < 1) throw std::invalid_argument(s);
    return v;
  } catch (const std::exception&) {
    usage_error(flag + " expects a positive integer, got '" + s + "'");
  }
}

std::vector<int64_t> parse_list(const std::string& flag, const std::string& s) {
  std::vector<int64_t> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(parse_int(flag, item));
  if (out.empty()) usage_error(flag + " expects a comma-separated list");
  return out;
}

struct Args {
  Problem problem;
  std::vector<int64_t> ns{512, 1024, 2048, 4096, 8192, 16384, 32768, 65536};
  int threads = 0;
  std::string methods;
  bool forward_only = false;
  std::string csv;
  int64_t exact_max_n = 16384;
  bool torch = true;
  std::string plots;
  linattn::bench::AccuracyOptions accuracy;
  bool n_set = false, heads_set = false;
  linattn::bench::MethodSizes sizes;
};

Args parse_args(int argc, char** argv, int first) {
  Args a;
  for (int i = first; i < argc; ++i) {
    const std::string f = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(f + " needs a value");
      return argv[++i];
    };
    if (f == "--n") a.ns = parse_list(f, value()), a.n_set = true;
    else if (f == "--batch") a.problem.batch = parse_int(f, value());
    else if (f == "--heads") a.problem.heads = parse_int(f, value()), a.heads_set = true;
    else if (f == "--head-dim") a.problem.head_dim = parse_int(f, value());
    else if (f == "--threads") a.threads = static_cast<int>(parse_int(f, value()));
    else if (f == "--methods") a.methods = value();
    else if (f == "--forward-only") a.forward_only = true;
    else if (f == "--csv") a.csv = value();
    else if (f == "--exact-max-n") a.exact_max_n = parse_int(f, value());
    else if (f == "--no-torch") a.torch = false;
    else if (f == "--m") a.sizes["num_features"] = parse_int(f, value());
    else if (f == "--landmarks") a.sizes["num_landmarks"] = parse_int(f, value());
    else if (f == "--s-proj") a.sizes["s_proj"] = parse_int(f, value());
    else if (f == "--out") a.accuracy.out_dir = value();
    else if (f == "--seeds") a.accuracy.seeds = static_cast<int>(parse_int(f, value()));
    else if (f == "--plots") a.plots = value();
    else usage_error("unknown option '" + f + "'");
  }
  if (a.threads > 0) linattn::set_num_threads(a.threads);
  // Fail now, in one line, rather than after minutes of work.
  if (!a.plots.empty()) linattn::bench::require_writable_dir("--plots", a.plots);
  if (!a.csv.empty())
    linattn::bench::require_writable_dir("--csv", std::filesystem::absolute(a.csv).parent_path().string());
  for (const int64_t n : a.ns) {
    const Problem& p = a.problem;
    // q, k, v, dout and an output, float32, plus the same again for a backward's gradients.
    const double bytes = 8.0 * double(p.batch) * double(p.heads) * double(n) * double(p.head_dim) * 4;
    linattn::bench::require_memory("--n " + std::to_string(n) + " (B=" + std::to_string(p.batch) +
                                       " H=" + std::to_string(p.heads) + " d=" + std::to_string(p.head_dim) + ")",
                                   bytes);
  }
  return a;
}

std::vector<Method> selected_methods(const std::string& filter,
                                     const linattn::bench::MethodSizes& sizes) {
  std::vector<Method> out;
  std::vector<std::string> wanted;
  std::stringstream ss(filter);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) wanted.push_back(item);
  for (auto& m : linattn::bench::all_methods(sizes))
    if (wanted.empty() || std::any_of(wanted.begin(), wanted.end(), [&](const std::string& w) {
          return m.name.find(w) != std::string::npos;
        }))
      out.push_back(m);
  if (out.empty()) usage_error("no method matches --methods '" + filter + "'");
  return out;
}

// The bfloat16 dot-product peak (vdpbf16ps), which the bfloat16 exact attention runs on.
std::string bf16_peak_text(double p) {
  if (p == 0) return "no bfloat16 dot-product peak (no AVX512-BF16)";
  char buf[96];
  std::snprintf(buf, sizeof buf, "bfloat16 dot-product peak (vdpbf16ps loop): %.1f GFLOP/s", p);
  return buf;
}

int demo(const Args& a) {
  Problem p = a.problem;
  p.n = 4096;
  const double gemm = linattn::bench::sgemm_gflops(linattn::num_threads());
  const linattn::PeakRates peaks = linattn::measure_peak_rates(linattn::num_threads());
  const double peak = peaks.float32_fma_gflops;
  std::printf("linattn demo: B=%lld H=%lld n=%lld d=%lld float32, random N(0,1) inputs\n",
              (long long)p.batch, (long long)p.heads, (long long)p.n, (long long)p.head_dim);
  std::printf("machine: %s\n", linattn::bench::machine_summary().c_str());
  std::printf("measured sgemm rate: %.1f GFLOP/s; FMA peak (register-only loop): %.1f GFLOP/s; %s\n\n", gemm, peak,
              bf16_peak_text(peaks.bfloat16_dot_gflops).c_str());
  std::printf("%-28s %10s %9s %8s %7s %13s %13s %11s %11s\n", "method", "time (ms)", "GFLOP/s",
              "% sgemm", "% peak", "extra (wksp)", "extra (RSS)", "err vs own", "vs softmax");
  const auto in = linattn::bench::make_inputs(p);
  for (const auto& m : selected_methods(a.methods, a.sizes)) {
    linattn::Tensor<float> out;
    const auto mem = linattn::bench::measure_peak_memory([&] { out = m.forward(in); });
    const auto t = linattn::bench::time_runs([&] { out = m.forward(in); }, 1, 5, 1.0);
    const double gflops = m.forward_flops(p) / t.median_s * 1e-9;
    const double own = m.own_error(in, out, 64);
    const double err = linattn::bench::error_vs_exact(m, in, out, 64);
    std::printf("%-28s %10.2f %9.1f %7.0f%% %6.0f%% %13s %13s %11.2e %11.2e\n", m.name.c_str(),
                t.median_s * 1e3, gflops, 100 * gflops / gemm, 100 * gflops / peak,
                linattn::bench::human_bytes(mem.workspace_bytes).c_str(),
                linattn::bench::human_bytes(mem.rss_growth_bytes).c_str(), own, err);
  }
  std::printf(
      "\ntime: median after warm-up; extra (wksp): peak scratch the library allocated beyond\n"
      "inputs and outputs (exact); extra (RSS): growth of the process's peak resident memory\n"
      "(outputs included; approximate: Linux updates RSS counters lazily per thread); err vs\n"
      "own: max |out - ref| / max |ref| over 64 rows of every head, ref = the method's own\n"
      "definition in float64 (numerical accuracy); vs softmax: the same against\n"
      "exact softmax attention in float64 (approximation error; 0 for exact methods up to\n"
      "rounding). Inputs are random N(0,1): real attention inputs are easier to approximate.\n");
  return 0;
}

// Decoding: time of one RecurrentState::step (FAVOR+, m = 256) after 1k and after 64k tokens
// of prefill; constant-size state, so the two should match.
void bench_recurrent(const Args& a) {
  Problem p = a.problem;
  const int64_t d = p.head_dim;
  const auto it = a.sizes.find("num_features");
  const int64_t m = it != a.sizes.end() ? it->second : linattn::method("favor").default_size;
  const auto w = linattn::random_features<float>(m, d, linattn::FeatureKind::Orthogonal, 42);
  linattn::RecurrentOptions o;
  o.feature_map = "favor";
  const std::string title = "recurrent step (favor+ m=" + std::to_string(m) + ")";
  std::printf("\n%-26s %9s %14s %12s\n", title.c_str(), "after", "time (us)", "GFLOP/s");
  Problem one = p;
  one.n = 1;
  const auto tok = linattn::bench::make_inputs(one);
  const linattn::Tensor<float> qt = [&] {
    linattn::Tensor<float> t({p.batch, p.heads, d});
    std::copy(tok.q.data(), tok.q.data() + t.size(), t.data());
    return t;
  }();
  // Both states first, then their steps timed in alternating rounds, so drift in the machine's
  // speed hits both alike.
  std::vector<int64_t> positions{1024, 65536};
  std::vector<linattn::RecurrentState<float>> states;
  for (const int64_t pos : positions) {
    std::fprintf(stderr, "\r[bench] prefill %lld tokens ...          ", (long long)pos);
    p.n = pos;
    const auto in = linattn::bench::make_inputs(p);
    states.emplace_back(p.batch, p.heads, d, d, o, w.view());
    states.back().prefill(in.q, in.k, in.v);
  }
  std::vector<std::vector<double>> medians(positions.size());
  for (int round = 0; round < 5; ++round)
    for (size_t i = 0; i < states.size(); ++i)
      medians[i].push_back(
          linattn::bench::time_runs([&] { (void)states[i].step(qt, qt, qt); }, 20, 200, 0.2, 2000).median_s);
  std::fprintf(stderr, "\r%80s\r", "");
  // Per step and head: two feature maps (2·m·d each) and the state update and read (2·m·d_v each).
  const double flops = 4.0 * double(m) * double(d + d) * double(p.batch * p.heads);
  for (size_t i = 0; i < positions.size(); ++i) {
    std::sort(medians[i].begin(), medians[i].end());
    const double t = medians[i][medians[i].size() / 2];
    std::printf("%-26s %9lld %14.1f %12.2f\n", "", (long long)positions[i], t * 1e6, flops / t * 1e-9);
  }
}

struct Row {
  const Method* method = nullptr;
  int64_t n = 0;
  std::string pass;
  double flops = 0, median_s = 0;
  linattn::bench::Timing timing;
  linattn::bench::PeakMemory memory;
  std::vector<linattn::bench::PeerResult> peers;
};

// The median time of `peer` on row r, or -1 when it did not run.
double peer_time(const Row& r, const std::string& peer) {
  for (const auto& t : r.peers)
    if (t.peer == peer && t.status == "ok") return t.median_s;
  return -1;
}

// The smallest n of the sweep from which `method` (at `pass`) stays faster than exact attention
// with the same causality, in this run — linattn's own (peer empty) or a peer's ("torch sdpa");
// -1 if never within the measured range.
int64_t crossover(const std::vector<Row>& rows, const Row& r, const std::string& peer = "") {
  const std::string exact = r.method->causal ? "exact softmax (causal)" : "exact softmax";
  int64_t from = -1;
  for (const Row& x : rows) {
    if (x.method != r.method || x.pass != r.pass) continue;
    for (const Row& e : rows)
      if (e.method->name == exact && e.n == x.n && e.pass == x.pass) {
        const double t = peer.empty() ? e.median_s : peer_time(e, peer);
        if (t < 0) continue;
        if (x.median_s < t) {
          if (from < 0) from = x.n;
        } else {
          from = -1;  // slower again: the crossover is later
        }
      }
  }
  return from;
}

int bench(const Args& a) {
  if (a.methods == "recurrent") {  // decoding only
    bench_recurrent(a);
    return 0;
  }
  const auto methods = selected_methods(a.methods, a.sizes);
  const double gemm = linattn::bench::sgemm_gflops(linattn::num_threads());
  const linattn::PeakRates peaks = linattn::measure_peak_rates(linattn::num_threads());
  const double peak = peaks.float32_fma_gflops;
  const std::string python = linattn::bench::python(), bench_dir = linattn::bench::scripts_dir();
  const linattn::bench::TorchCheck torch =
      a.torch ? linattn::bench::check_torch(python) : linattn::bench::TorchCheck{"", "--no-torch"};
  const std::string& no_torch = torch.why_not;
  std::printf("linattn bench: B=%lld H=%lld d=%lld float32\nmachine: %s\n",
              (long long)a.problem.batch, (long long)a.problem.heads,
              (long long)a.problem.head_dim, linattn::bench::machine_summary().c_str());
  std::printf("measured sgemm rate (2048^3, %d threads): %.1f GFLOP/s; FMA peak (register-only loop): %.1f GFLOP/s; %s\n",
              linattn::num_threads(), gemm, peak, bf16_peak_text(peaks.bfloat16_dot_gflops).c_str());
  if (no_torch.empty())
    std::printf("peers: the same inputs through torch sdpa, performer-pytorch, nystrom-attention, linformer "
                "and plain PyTorch (bench/torch_bench.py), torch %s, torch.set_num_threads(%d), "
                "OMP_WAIT_POLICY=passive\n\n",
                torch.version.c_str(), linattn::num_threads());
  else
    std::printf("peers: not compared (%s)\n\n", no_torch.c_str());
  std::printf("%-26s %7s %-8s %9s %11s %9s %8s %7s %13s %13s\n", "method", "n", "pass", "GFLOP", "time (ms)",
              "GFLOP/s", "% sgemm", "% peak", "extra (wksp)", "extra (RSS)");
  std::printf("%-26s %7s %-8s %9s %11s %9s %8s\n", "  vs peer", "", "", "", "time (ms)", "GFLOP/s",
              "ours/it");
  std::string csv_path = a.csv;
  if (csv_path.empty() && !a.plots.empty()) csv_path = a.plots + "/bench.csv";
  std::ofstream csv;
  if (!csv_path.empty()) {
    csv.open(csv_path);
    if (!csv) throw std::runtime_error("cannot write " + csv_path);
    // One row per implementation: impl is "linattn" or the peer; workspace_bytes is linattn's.
    csv << "method,causal,n,batch,heads,head_dim,pass,impl,status,flops,median_s,min_s,runs,gflops,"
           "fraction_of_sgemm,workspace_bytes,rss_growth_bytes,sgemm_gflops,threads,note,fma_peak_gflops\n";
  }
  std::vector<Row> rows;
  for (const int64_t n : a.ns) {
    Problem p = a.problem;
    p.n = n;
    const auto in = linattn::bench::make_inputs(p);
    std::vector<const Method*> run_here;
    const size_t first = rows.size();
    for (const auto& m : methods) {
      if (m.name.rfind("exact", 0) == 0 && n > a.exact_max_n) {
        std::printf("%-26s %7lld skipped: n > --exact-max-n %lld\n", m.name.c_str(), (long long)n,
                    (long long)a.exact_max_n);
        continue;
      }
      run_here.push_back(&m);
      for (int pass = 0; pass < (a.forward_only ? 1 : 2); ++pass) {
        Row r;
        r.method = &m;
        r.n = n;
        r.pass = pass == 0 ? "fwd" : "fwd+bwd";
        r.flops = m.forward_flops(p) + (pass == 1 ? m.backward_flops(p) : 0.0);
        std::fprintf(stderr, "\r[bench] %s n=%lld %s ...          ", m.name.c_str(), (long long)n,
                     r.pass.c_str());
        std::function<void()> run = [&] { (void)m.forward(in); };
        if (pass == 1) run = [&] { m.forward_backward(in); };
        r.memory = linattn::bench::measure_peak_memory(run);  // also the warm-up
        r.timing = linattn::bench::time_runs(run, 0, n >= 16384 ? 2 : 5, 1.0);
        r.median_s = r.timing.median_s;
        rows.push_back(r);
      }
    }
    if (no_torch.empty() && !run_here.empty()) {
      std::fprintf(stderr, "\r[bench] PyTorch n=%lld ...                              ", (long long)n);
      const auto peers = linattn::bench::run_peers(p, in, run_here, a.forward_only, linattn::num_threads(),
                                                   python, bench_dir + "/torch_bench.py");
      for (size_t i = first; i < rows.size(); ++i) {
        const auto it = peers.find({rows[i].method->name, rows[i].pass});
        if (it != peers.end()) rows[i].peers = it->second;
      }
    }
    std::fprintf(stderr, "\r%80s\r", "");
    for (size_t i = first; i < rows.size(); ++i) {
      const Row& r = rows[i];
      const double gflops = r.flops / r.median_s * 1e-9;
      std::printf("%-26s %7lld %-8s %9.1f %11.2f %9.1f %7.0f%% %6.0f%% %13s %13s\n", r.method->name.c_str(),
                  (long long)n, r.pass.c_str(), r.flops * 1e-9, r.median_s * 1e3, gflops, 100 * gflops / gemm,
                  100 * gflops / peak,
                  linattn::bench::human_bytes(r.memory.workspace_bytes).c_str(),
                  linattn::bench::human_bytes(r.memory.rss_growth_bytes).c_str());
      for (const auto& t : r.peers) {
        if (t.status == "ok")
          std::printf("  vs %-22s %7s %-8s %9s %11.2f %9.1f %8.2f %13s %13s\n", t.peer.c_str(), "", "", "",
                      t.median_s * 1e3, r.flops / t.median_s * 1e-9, r.median_s / t.median_s, "",
                      linattn::bench::human_bytes(t.rss_growth_bytes).c_str());
        else
          std::printf("  vs %-22s %7s %-8s %9s %s%s\n", t.peer.c_str(), "", "", "", t.status.c_str(),
                      t.note.empty() ? "" : (" (" + t.note + ")").c_str());
      }
      if (!csv) continue;
      auto line = [&](const std::string& impl, const std::string& status, double median_s, double min_s,
                      int runs, int64_t workspace, int64_t rss, const std::string& note) {
        const double rate = median_s > 0 ? r.flops / median_s * 1e-9 : 0;
        csv << '"' << r.method->name << "\"," << r.method->causal << ',' << n << ',' << p.batch << ','
            << p.heads << ',' << p.head_dim << ',' << r.pass << ",\"" << impl << "\"," << status << ','
            << r.flops << ',' << median_s << ',' << min_s << ',' << runs << ',' << rate << ',' << rate / gemm
            << ',' << workspace << ',' << rss << ',' << gemm << ',' << linattn::num_threads() << ",\"" << note
            << "\"," << peak << "\n";
      };
      line("linattn", "ok", r.median_s, r.timing.min_s, r.timing.runs, r.memory.workspace_bytes,
           r.memory.rss_growth_bytes, "");
      for (const auto& t : r.peers) line(t.peer, t.status, t.median_s, 0, t.runs, -1, t.rss_growth_bytes, t.note);
    }
    std::fflush(stdout);
    csv.flush();
  }
  std::printf("\ncrossover (smallest n of this sweep from which the method stays faster than our exact "
              "attention, and than torch sdpa, same causality and pass):\n");
  for (const Row& r : rows) {
    if (r.method->name.rfind("exact", 0) == 0 || r.n != rows.front().n) continue;
    auto show = [](int64_t from) { return from > 0 ? "n = " + std::to_string(from) : std::string("not within the measured n"); };
    std::printf("  %-26s %-8s %-28s", r.method->name.c_str(), r.pass.c_str(), show(crossover(rows, r)).c_str());
    if (no_torch.empty()) std::printf("  (torch sdpa: %s)", show(crossover(rows, r, "torch sdpa")).c_str());
    std::printf("\n");
  }
  if (!a.plots.empty()) {
    csv.close();
    const std::string cmd = python + " " + bench_dir + "/plot_bench.py " + csv_path + " " + a.plots;
    if (std::system(cmd.c_str()) != 0)
      std::fprintf(stderr, "linattn: plotting failed (%s); the CSV is %s\n", cmd.c_str(), csv_path.c_str());
  }
  if (a.methods.empty() || std::string("favor").find(a.methods) != std::string::npos ||
      a.methods.find("recurrent") != std::string::npos)
    bench_recurrent(a);
  std::printf("\nFLOPs per head: exact attention 4·n_pairs·d forward, 10·n_pairs·d backward "
              "(n_pairs = n² or n(n+1)/2 causal);\nkernelized 4·n·m·(d + d_v) forward (m = d for "
              "elu), backward counted as 2× forward;\nnystrom 4·n·m·(d + d_v) + 2m²(d + d_v) + "
              "8·T·m³ forward, n·m·(12d + 10d_v) + 8m²(d + d_v) + 22·T·m³ backward (T = 6);\n"
              "linformer 4·n·s·(d + d_v) forward, n·s·(12d + 10d_v) backward; efficient attention "
              "4·n·d·d_v forward, 10·n·d·d_v backward.\n");
  return 0;
}

int accuracy(const Args& a) {
  linattn::bench::AccuracyOptions o = a.accuracy;
  o.heads = a.heads_set ? a.problem.heads : 4;
  o.head_dim = a.problem.head_dim;
  if (a.n_set) o.n = a.ns.front();
  linattn::bench::require_writable_dir("--out", o.out_dir);
  std::printf("linattn accuracy: H=%lld d=%lld n=%lld, %d seeds, float64; writing %s\n", (long long)o.heads,
              (long long)o.head_dim, (long long)o.n, o.seeds, o.out_dir.c_str());
  linattn::bench::run_accuracy(o);
  const std::string python = linattn::bench::python(), bench_dir = linattn::bench::scripts_dir();
  const std::string cmd = python + " " + bench_dir + "/plot_accuracy.py " + o.out_dir;
  if (std::system(cmd.c_str()) != 0)
    std::fprintf(stderr, "linattn: plotting failed (%s); the CSV files are in %s\n", cmd.c_str(), o.out_dir.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const std::string cmd = argv[1];
  try {
    const Args args = parse_args(argc, argv, 2);
    if (cmd == "demo") return demo(args);
    if (cmd == "bench") return bench(args);
    if (cmd == "accuracy") return accuracy(args);
  } catch (const std::exception& e) {  // bad arguments, out of memory, unwritable files: one line
    std::fprintf(stderr, "linattn: %s\n", e.what());
    return 1;
  }
  usage_error("unknown command '" + cmd + "'");
}
