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

TorchCheck check_torch(const std::string& python) {
  const std::string cmd = python + " -c 'import torch; print(torch.__version__)' 2> /dev/null";
  std::string out;
  if (FILE* f = popen(cmd.c_str(), "r")) {
    char buf[128];
    while (std::fgets(buf, sizeof buf, f)) out += buf;
    pclose(f);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  if (!out.empty()) return {out, ""};
  return {"", "PyTorch cannot be imported by " + python +
                  " (make bench installs requirements/torch.txt into .venv and sets LINATTN_PYTHON)"};
}

std::map<std::pair<std::string, std::string>, std::vector<PeerResult>> run_peers(
    const Problem& p, const Inputs& in, const std::vector<const Method*>& methods,
    bool forward_only, int threads, const std::string& python, const std::string& script) {
  std::map<std::pair<std::string, std::string>, std::vector<PeerResult>> results;
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
  std::getline(res, line);  // header: method,causal,pass,peer,status,median_s,runs,rss_growth_bytes,note
  while (std::getline(res, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();  // Python's csv may end rows with \r\n
    const auto f = split_csv_line(line);
    if (f.size() < 9) continue;
    PeerResult r;
    r.peer = f[3];
    r.status = f[4];
    if (!f[5].empty()) r.median_s = std::stod(f[5]);
    if (!f[6].empty()) r.runs = std::stoi(f[6]);
    if (!f[7].empty()) r.rss_growth_bytes = std::stoll(f[7]);
    r.note = f[8];
    results[{f[0], f[2]}].push_back(r);
  }
  if (rc != 0)  // the helper crashed (e.g. out of memory): say so on every row it left out
    for (const Method* m : methods)
      for (const char* pass : {"fwd", "fwd+bwd"})
        if (!results.count({m->name, pass}))
          results[{m->name, pass}].push_back(
              {"torch", "failed", 0, 0, -1, "the PyTorch helper exited with status " + std::to_string(rc)});
  std::filesystem::remove_all(dir);
  return results;
}

}  // namespace linattn::bench
