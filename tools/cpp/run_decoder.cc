// Runs an exported decoder library (prefill, then greedy decode) with TVM's C++ runtime alone.
//
//   run_decoder <library.so> <inputs dir> <decode steps>
//
// <inputs dir> holds `params.txt` (one line per weight, in the order the functions take them:
// "<dtype> <dim0> <dim1> ..."), `params.bin` (their bytes, concatenated) and `prompt.txt` (token ids).
// The library is a Relax executable of mqa_byoc.models.llama.build_decoder (prefill(input_ids,
// *weights) -> (logits, caches); decode(input_id, caches, *weights) -> (logits, caches); float32
// logits), exported with every kernel compiled (mqa_byoc.build(..., cuda_binary=True)): no Python, no
// compiler. Prints, per step, the logits' sum, sum of squares and the greedy next token, and writes the
// last-position logits of every step to `<inputs dir>/cpp_logits.bin` (float32).
//
// Uses only tvm-ffi's API and the TVM runtime's global functions (libtvm_runtime.so, with
// libtvm_runtime_cuda.so linked for the CUDA device API and the "cuda" module loader).

#include <dlpack/dlpack.h>
#include <tvm/ffi/any.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/string.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace ffi = tvm::ffi;

namespace {

struct Param {
  DLDataType dtype;
  std::vector<int64_t> shape;
  size_t nbytes;
};

ffi::Function global(const char* name) {
  auto f = ffi::Function::GetGlobal(name);
  if (!f.has_value()) {
    std::cerr << "TVM runtime function " << name << " not found\n";
    std::exit(2);
  }
  return *f;
}

DLDataType parse_dtype(const std::string& s) {
  if (s == "float16") return DLDataType{kDLFloat, 16, 1};
  if (s == "bfloat16") return DLDataType{kDLBfloat, 16, 1};
  if (s == "float32") return DLDataType{kDLFloat, 32, 1};
  if (s == "int32") return DLDataType{kDLInt, 32, 1};
  std::cerr << "unsupported dtype " << s << "\n";
  std::exit(2);
}

ffi::Tensor empty(const std::vector<int64_t>& shape, DLDataType dtype, DLDevice dev) {
  static ffi::Function alloc = global("runtime.TVMTensorAllocWithScope");
  return alloc(ffi::Shape(shape), dtype, dev, ffi::Optional<ffi::String>()).cast<ffi::Tensor>();
}

void copy_in(const ffi::Tensor& t, const void* data, size_t nbytes) {
  static ffi::Function f = global("runtime.TVMTensorCopyFromBytes");
  f(t, const_cast<void*>(data), static_cast<int64_t>(nbytes));
}

void copy_out(const ffi::Tensor& t, void* data, size_t nbytes) {
  static ffi::Function f = global("runtime.TVMTensorCopyToBytes");
  f(t, data, static_cast<int64_t>(nbytes));
}

// Calls fn(prefix..., weights...) and returns its (logits, caches) tuple.
ffi::Array<ffi::Any> call(const ffi::Function& fn, const std::vector<ffi::Any>& prefix,
                          const std::vector<ffi::Tensor>& weights) {
  std::vector<ffi::AnyView> args;
  for (const auto& a : prefix) args.emplace_back(a);
  for (const auto& w : weights) args.emplace_back(w);
  ffi::Any rv;
  fn.CallPacked(args.data(), static_cast<int32_t>(args.size()), &rv);
  return rv.cast<ffi::Array<ffi::Any>>();
}

// The last position's logits (float32) of (B=1, S, V) logits.
std::vector<float> last_logits(const ffi::Tensor& logits) {
  const int64_t s = logits.size(1), v = logits.size(2);
  std::vector<float> all(static_cast<size_t>(s * v));
  copy_out(logits, all.data(), all.size() * sizeof(float));
  return std::vector<float>(all.end() - v, all.end());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: run_decoder <library.so> <inputs dir> <decode steps>\n";
    return 2;
  }
  const std::string lib_path = argv[1], dir = argv[2];
  const int steps = std::atoi(argv[3]);
  const DLDevice gpu{kDLCUDA, 0}, cpu{kDLCPU, 0};

  ffi::Module lib = ffi::Module::LoadFromFile(lib_path);
  ffi::Module vm = lib->GetFunction("vm_load_executable", true).value()().cast<ffi::Module>();
  // devices: (type, id, allocator) for the GPU, then the host; 2 = pooled allocator
  vm->GetFunction("vm_initialization", true).value()(static_cast<int>(kDLCUDA), 0, 2, static_cast<int>(kDLCPU), 0, 2);
  ffi::Function prefill = vm->GetFunction("prefill", true).value();
  ffi::Function decode = vm->GetFunction("decode", true).value();

  std::vector<Param> params;
  {
    std::ifstream f(dir + "/params.txt");
    std::string line;
    while (std::getline(f, line)) {
      if (line.empty()) continue;
      std::istringstream is(line);
      std::string dt;
      is >> dt;
      Param p{parse_dtype(dt), {}, 0};
      int64_t d, n = 1;
      while (is >> d) p.shape.push_back(d), n *= d;
      p.nbytes = static_cast<size_t>(n) * p.dtype.bits / 8;
      params.push_back(p);
    }
  }
  std::vector<ffi::Tensor> weights;
  {
    std::ifstream f(dir + "/params.bin", std::ios::binary);
    std::vector<char> buf;
    for (const Param& p : params) {
      buf.resize(p.nbytes);
      if (!f.read(buf.data(), static_cast<std::streamsize>(p.nbytes))) {
        std::cerr << "params.bin is shorter than params.txt says\n";
        return 2;
      }
      ffi::Tensor t = empty(p.shape, p.dtype, gpu);
      copy_in(t, buf.data(), p.nbytes);
      weights.push_back(t);
    }
  }
  std::vector<int32_t> prompt;
  {
    std::ifstream f(dir + "/prompt.txt");
    int32_t id;
    while (f >> id) prompt.push_back(id);
  }
  std::printf("loaded %s: %zu weights, prompt of %zu tokens\n", lib_path.c_str(), weights.size(), prompt.size());

  std::ofstream dump(dir + "/cpp_logits.bin", std::ios::binary);
  auto report = [&](const char* what, int step, const std::vector<float>& logits) {
    double sum = 0, sq = 0;
    int best = 0;
    for (size_t i = 0; i < logits.size(); ++i) {
      sum += logits[i];
      sq += double(logits[i]) * logits[i];
      if (logits[i] > logits[best]) best = static_cast<int>(i);
    }
    std::printf("%s %d sum=%.6f sumsq=%.6f next=%d\n", what, step, sum, sq, best);
    dump.write(reinterpret_cast<const char*>(logits.data()), static_cast<std::streamsize>(logits.size() * 4));
    return best;
  };

  ffi::Tensor ids = empty({1, static_cast<int64_t>(prompt.size())}, DLDataType{kDLInt, 32, 1}, gpu);
  copy_in(ids, prompt.data(), prompt.size() * 4);
  ffi::Array<ffi::Any> out = call(prefill, {ffi::Any(ids)}, weights);
  int32_t next = report("prefill", 0, last_logits(out[0].cast<ffi::Tensor>()));
  ffi::Any caches = out[1];
  for (int step = 1; step <= steps; ++step) {
    ffi::Tensor one = empty({1, 1}, DLDataType{kDLInt, 32, 1}, gpu);
    copy_in(one, &next, 4);
    out = call(decode, {ffi::Any(one), caches}, weights);
    next = report("decode", step, last_logits(out[0].cast<ffi::Tensor>()));
    caches = out[1];
  }
  (void)cpu;
  std::printf("done\n");
  return 0;
}
