// Argument checks shared by every op's binding (LibTorch stable ABI): each names the
// argument, what it is and what is required, and throws std::invalid_argument (a Python
// ValueError) before anything is launched. Checks of what a tensor is (dtype, rank,
// contiguity, shape) come before where it is, so they all answer for CPU tensors too.
#pragma once

#include <cuda_runtime.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/tensor.h>

#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace prime_kernels::binding {
// Internal to each binding's translation unit, as torch's stable Tensor is.
namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

template <typename... Parts>
[[noreturn]] void fail(const char* op, const Parts&... parts) {
  std::ostringstream message;
  message << op << ": ";
  (message << ... << parts);
  throw std::invalid_argument(message.str());
}

inline std::string shape_of(const Tensor& t) {
  std::ostringstream text;
  text << "(";
  for (int64_t d = 0; d < t.dim(); ++d) text << (d ? ", " : "") << t.size(d);
  text << (t.dim() == 1 ? ",)" : ")");
  return text.str();
}

// Dtype names as Python users write them.
inline std::string dtype_name(ScalarType type) {
  switch (type) {
    case ScalarType::BFloat16:
      return "torch.bfloat16";
    case ScalarType::Half:
      return "torch.float16";
    case ScalarType::Float:
      return "torch.float32";
    case ScalarType::Double:
      return "torch.float64";
    case ScalarType::Int:
      return "torch.int32";
    case ScalarType::Long:
      return "torch.int64";
    case ScalarType::Byte:
      return "torch.uint8";
    case ScalarType::Float8_e4m3fn:
      return "torch.float8_e4m3fn";
    case ScalarType::Float8_e8m0fnu:
      return "torch.float8_e8m0fnu";
    default:
      return std::string("torch.") + torch::headeronly::toString(type);
  }
}

struct TensorArg {
  const char* name;
  const Tensor& tensor;
  ScalarType dtype;
  int64_t rank;
};

// What a tensor is, before where it is: dtypes of all arguments first, then rank and
// contiguity, so a call with CPU tensors still learns every mistake in its shapes (and the
// checks can be exercised without a GPU). check_devices comes after the shape checks.
inline void check_tensors(const char* op, const std::vector<TensorArg>& args) {
  for (const TensorArg& arg : args) {
    if (arg.tensor.scalar_type() != arg.dtype) {
      fail(op, "argument '", arg.name, "' must be a ", dtype_name(arg.dtype), " tensor, got ",
           dtype_name(arg.tensor.scalar_type()));
    }
  }
  for (const TensorArg& arg : args) {
    const Tensor& t = arg.tensor;
    if (t.dim() != arg.rank) {
      fail(op, "argument '", arg.name, "' must be ", arg.rank, "-D, got shape ", shape_of(t));
    }
    if (!t.is_contiguous()) {
      fail(op, "argument '", arg.name, "' must be contiguous, got shape ", shape_of(t),
           " with non-contiguous strides");
    }
  }
}

// Every tensor on the CUDA device of the first one; returns that device's index.
inline int32_t check_devices(const char* op, const std::vector<TensorArg>& args) {
  const TensorArg& first = *args.begin();
  for (const TensorArg& arg : args) {
    if (!arg.tensor.is_cuda()) {
      fail(op, "argument '", arg.name, "' must be on a CUDA device, got a CPU tensor");
    }
    if (arg.tensor.get_device_index() != first.tensor.get_device_index()) {
      fail(op, "argument '", arg.name, "' is on cuda:", int(arg.tensor.get_device_index()),
           " but '", first.name, "' is on cuda:", int(first.tensor.get_device_index()),
           "; all tensors must be on one CUDA device");
    }
  }
  return first.tensor.get_device_index();
}

inline void check_shape(const char* op, const char* name, const Tensor& t,
                        const std::vector<int64_t>& expected, const char* meaning) {
  bool same = t.dim() == static_cast<int64_t>(expected.size());
  for (int64_t d = 0; same && d < t.dim(); ++d) same = t.size(d) == expected[d];
  if (!same) {
    std::ostringstream want;
    want << "(";
    for (size_t d = 0; d < expected.size(); ++d) want << (d ? ", " : "") << expected[d];
    want << (expected.size() == 1 ? ",)" : ")");
    fail(op, "argument '", name, "' must have shape ", want.str(), " ", meaning, ", got ",
         shape_of(t));
  }
}

inline cudaStream_t current_stream(int32_t device_index) {
  void* stream = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(device_index, &stream));
  return static_cast<cudaStream_t>(stream);
}

inline void check_cuda(const char* op, cudaError_t status) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(op) + ": CUDA error: " + cudaGetErrorString(status));
  }
}

}  // namespace
}  // namespace prime_kernels::binding
