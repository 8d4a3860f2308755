// rankscope: the events of a stopped torch.profiler as packed columns, read in C++ without the GIL.
//
// read_columns(result) walks ProfilerResult::events() once and returns little-endian byte buffers
// (one per column, see COLUMNS in producers/native_extract.py) plus the distinct event names and the
// Kineto activity-type name table; details(result, rows) returns, for the few rows that need it
// (collectives, device events), (metadata_json, extra_meta, shapes, dtypes). Python turns the
// buffers into numpy arrays and categorises per distinct (type, name), not per event.
//
// The window-conversion kernels of window_math.h are bound here too (call_paths, exclusive_times,
// group_stats): int64 numpy arrays in and out, computed with the GIL released.
#include <torch/extension.h>
#include <pybind11/numpy.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <kineto/ActivityType.h>

#include <string>
#include <unordered_map>
#include <vector>

#include "window_math.h"

namespace py = pybind11;
using torch::autograd::profiler::KinetoEvent;
using torch::autograd::profiler::ProfilerResult;

namespace {

constexpr uint8_t kPythonFunction = static_cast<uint8_t>(libkineto::ActivityType::PYTHON_FUNCTION);

template <typename T>
py::bytes as_bytes(const std::vector<T>& v) {
  return py::bytes(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

const ProfilerResult& result_of(const py::object& obj) {
  return obj.cast<const ProfilerResult&>();  // raises a cast error for anything else
}

py::dict read_columns(const py::object& obj) {
  const ProfilerResult& result = result_of(obj);
  const std::vector<KinetoEvent>& events = result.events();
  const size_t n = events.size();
  std::vector<uint8_t> type(n), flags(n);
  std::vector<int8_t> device_type(n);
  std::vector<int32_t> name(n), device_index(n);
  std::vector<int64_t> start(n), dur(n), resource(n), corr(n), linked(n), py_id(n), py_parent(n);
  std::vector<std::string> names;
  uint64_t trace_start = 0;
  {
    py::gil_scoped_release nogil;
    trace_start = result.trace_start_ns();
    std::unordered_map<std::string, int32_t> index;
    for (size_t i = 0; i < n; ++i) {
      const KinetoEvent& e = events[i];
      std::string s = e.name();
      auto it = index.find(s);
      if (it == index.end()) {
        it = index.emplace(s, static_cast<int32_t>(names.size())).first;
        names.push_back(std::move(s));
      }
      name[i] = it->second;
      type[i] = e.activityType();
      start[i] = static_cast<int64_t>(e.startNs());
      dur[i] = static_cast<int64_t>(e.durationNs());
      resource[i] = e.deviceResourceId();
      corr[i] = static_cast<int64_t>(e.correlationId());
      const bool is_py = type[i] == kPythonFunction;
      py_id[i] = is_py ? e.pythonId() : -1;
      py_parent[i] = is_py ? e.pythonParentId() : -1;
      const c10::DeviceType dt = e.deviceType();
      device_type[i] = static_cast<int8_t>(dt);
      const bool on_device = dt != c10::DeviceType::CPU;
      device_index[i] = on_device ? e.deviceIndex() : -1;
      linked[i] = on_device ? static_cast<int64_t>(e.linkedCorrelationId()) : 0;
      flags[i] = (!is_py && e.isHiddenEvent()) ? 1 : 0;
    }
  }
  py::list type_names;
  std::vector<std::string> table(256, "");
  for (const auto& t : libkineto::_activityTypeNames) {
    if (t.name != nullptr && static_cast<int>(t.type) >= 0 && static_cast<int>(t.type) < 256) {
      table[static_cast<int>(t.type)] = t.name;
    }
  }
  for (const auto& s : table) type_names.append(py::str(s));
  py::list name_list;
  for (const auto& s : names) name_list.append(py::str(s));  // torch's own bindings decode names as UTF-8 too
  py::dict out;
  out["n"] = n;
  out["trace_start_ns"] = trace_start;
  out["names"] = name_list;
  out["type_names"] = type_names;
  out["type"] = as_bytes(type);
  out["flags"] = as_bytes(flags);
  out["device_type"] = as_bytes(device_type);
  out["name"] = as_bytes(name);
  out["device_index"] = as_bytes(device_index);
  out["start_ns"] = as_bytes(start);
  out["dur_ns"] = as_bytes(dur);
  out["resource"] = as_bytes(resource);
  out["corr"] = as_bytes(corr);
  out["linked"] = as_bytes(linked);
  out["py_id"] = as_bytes(py_id);
  out["py_parent"] = as_bytes(py_parent);
  return out;
}

py::list details(const py::object& obj, const std::vector<int64_t>& rows) {
  const ProfilerResult& result = result_of(obj);
  const std::vector<KinetoEvent>& events = result.events();
  py::list out;
  for (int64_t r : rows) {
    if (r < 0 || static_cast<size_t>(r) >= events.size()) {
      throw py::index_error("event row " + std::to_string(r) + " out of range");
    }
    const KinetoEvent& e = events[static_cast<size_t>(r)];
    py::dict extra;
    for (const auto& kv : e.extraMeta()) extra[py::str(kv.first)] = py::str(kv.second);
    py::list shapes;
    for (const auto& s : e.shapes()) {
      py::list dims;
      for (int64_t d : s) dims.append(d);
      shapes.append(dims);
    }
    py::list dtypes;
    for (const auto& d : e.dtypes()) dtypes.append(py::str(d));
    out.append(py::make_tuple(py::str(e.metadataJson()), extra, shapes, dtypes));
  }
  return out;
}

// Frees the result's events and event tree with the GIL released (the rank's training thread would
// otherwise wait ~2 ms per 4k-event window for the destructors). The result is empty afterwards:
// only for profilers that rankscope itself created and has finished reading.
void release_events(const py::object& obj) {
  ProfilerResult& result = const_cast<ProfilerResult&>(result_of(obj));
  std::vector<KinetoEvent> events;
  std::vector<torch::autograd::profiler::experimental_event_t> tree;
  events.swap(const_cast<std::vector<KinetoEvent>&>(result.events()));
  tree.swap(const_cast<std::vector<torch::autograd::profiler::experimental_event_t>&>(result.event_tree()));
  py::gil_scoped_release nogil;
  events.clear();
  tree.clear();
}

using I64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

py::array_t<int64_t> to_numpy(const std::vector<int64_t>& v) {
  py::array_t<int64_t> a(static_cast<py::ssize_t>(v.size()));
  if (!v.empty()) std::copy(v.begin(), v.end(), a.mutable_data());
  return a;
}

size_t same_length(std::initializer_list<const I64Array*> arrays) {
  const size_t n = static_cast<size_t>((*arrays.begin())->size());
  for (const I64Array* a : arrays) {
    if (a->ndim() != 1 || static_cast<size_t>(a->size()) != n) throw py::value_error("columns must be 1-d and of one length");
  }
  return n;
}

py::tuple call_paths(const I64Array& ids, const I64Array& parents, const I64Array& names) {
  const size_t n = same_length({&ids, &parents, &names});
  rankscope::CallPaths r;
  {
    py::gil_scoped_release nogil;
    r = rankscope::call_paths(ids.data(), parents.data(), names.data(), n);
  }
  return py::make_tuple(to_numpy(r.path), to_numpy(r.table_parent), to_numpy(r.table_name));
}

py::array_t<int64_t> exclusive_times(const I64Array& cat, const I64Array& start, const I64Array& dur,
                                     const I64Array& dev, const I64Array& tid, const py::dict& codes) {
  const size_t n = same_length({&cat, &start, &dur, &dev, &tid});
  rankscope::Codes c{codes["python"].cast<int64_t>(), codes["collective"].cast<int64_t>(),
                     codes["cpu_op"].cast<int64_t>(), codes["annotation"].cast<int64_t>(),
                     codes["gpu_work"].cast<std::vector<int64_t>>()};
  std::vector<int64_t> out;
  {
    py::gil_scoped_release nogil;
    out = rankscope::exclusive_times(cat.data(), start.data(), dur.data(), dev.data(), tid.data(), n, c);
  }
  return to_numpy(out);
}

py::tuple group_stats(const I64Array& key, const I64Array& dur, const I64Array& excl) {
  const size_t n = same_length({&key, &dur, &excl});
  rankscope::Groups g;
  {
    py::gil_scoped_release nogil;
    g = rankscope::group_stats(key.data(), dur.data(), excl.data(), n);
  }
  return py::make_tuple(to_numpy(g.key), to_numpy(g.count), to_numpy(g.total), to_numpy(g.median),
                        to_numpy(g.p95), to_numpy(g.max), to_numpy(g.excl));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rankscope: read torch.profiler results into columns without the GIL";
  m.attr("ABI") = 3;
  m.def("read_columns", &read_columns, py::arg("result"));
  m.def("details", &details, py::arg("result"), py::arg("rows"));
  m.def("release_events", &release_events, py::arg("result"));
  m.def("call_paths", &call_paths, py::arg("ids"), py::arg("parents"), py::arg("names"));
  m.def("exclusive_times", &exclusive_times, py::arg("category"), py::arg("start_ns"), py::arg("dur_ns"),
        py::arg("device"), py::arg("tid"), py::arg("codes"));
  m.def("group_stats", &group_stats, py::arg("key"), py::arg("dur_ns"), py::arg("exclusive_ns"));
}
