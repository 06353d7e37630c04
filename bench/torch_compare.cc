#include "torch_compare.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace linattn::bench {
namespace {

void write_raw(const std::string& path, const float* data, int64_t count) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(sizeof(float) * count));
  if (!f) throw std::runtime_error("cannot write " + path);
}

std::vector<std::string> split_csv_line(const std::string& line) {
  std::vector<std::string> out;
  std::string cur;
  bool quoted = false;
  for (char c : line) {
    if (c == '"') quoted = !quoted;
    else if (c == ',' && !quoted) out.push_back(cur), cur.clear();
    else cur += c;
  }
  out.push_back(cur);
  return out;
}

}  // namespace

std::string torch_unavailable_reason(const std::string& python) {
  const std::string cmd = python + " -c 'import torch' > /dev/null 2>&1";
  if (std::system(cmd.c_str()) == 0) return "";
  return "PyTorch cannot be imported by " + python +
         " (install python3-torch: LINATTN_WITH_BENCH_DEPS=1 scripts/install-deps.sh, or make bench)";
}

std::map<std::pair<std::string, std::string>, TorchResult> run_torch(
    const Problem& p, const Inputs& in, const std::vector<const Method*>& methods,
    bool forward_only, int threads, const std::string& python, const std::string& script) {
  std::map<std::pair<std::string, std::string>, TorchResult> results;
  char tmpl[] = "/tmp/linattn-bench-XXXXXX";
  if (!mkdtemp(tmpl)) throw std::runtime_error("cannot make a temporary folder");
  const std::string dir = tmpl;
  write_raw(dir + "/q.f32", in.q.data(), in.q.size());
  write_raw(dir + "/k.f32", in.k.data(), in.k.size());
  write_raw(dir + "/v.f32", in.v.data(), in.v.size());
  write_raw(dir + "/dout.f32", in.dout.data(), in.dout.size());
  std::ofstream req(dir + "/requests.csv");
  req << "dir,method,causal,pass,batch,heads,n,head_dim,threads\n";
  for (const Method* m : methods) {
    if (m->write_parameters) m->write_parameters(p, dir);
    for (int pass = 0; pass < (forward_only ? 1 : 2); ++pass)
      req << dir << ",\"" << m->name << "\"," << m->causal << ',' << (pass ? "fwd+bwd" : "fwd") << ','
          << p.batch << ',' << p.heads << ',' << p.n << ',' << p.head_dim << ',' << threads << '\n';
  }
  req.close();
  const std::string cmd = "OMP_WAIT_POLICY=passive " + python + " " + script + " " + dir +
                          "/requests.csv " + dir + "/results.csv";
  const int rc = std::system(cmd.c_str());
  std::ifstream res(dir + "/results.csv");
  std::string line;
  std::getline(res, line);  // header
  while (std::getline(res, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();  // Python's csv ends rows with \r\n
    const auto f = split_csv_line(line);
    if (f.size() < 8) continue;
    TorchResult r;
    r.status = f[3];
    if (!f[4].empty()) r.median_s = std::stod(f[4]);
    if (!f[5].empty()) r.runs = std::stoi(f[5]);
    if (!f[6].empty()) r.rss_growth_bytes = std::stoll(f[6]);
    r.note = f[7];
    results[{f[0], f[2]}] = r;
  }
  if (rc != 0)  // rows the helper did not get to (it crashed, e.g. out of memory)
    for (const Method* m : methods)
      for (const char* pass : {"fwd", "fwd+bwd"})
        if (!results.count({m->name, pass}))
          results[{m->name, pass}] = {"failed", 0, 0, -1, "the PyTorch helper exited with status " + std::to_string(rc)};
  std::filesystem::remove_all(dir);
  return results;
}

}  // namespace linattn::bench
