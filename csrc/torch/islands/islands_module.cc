// The Python face of ProcessGroupIslands (pycomm._C.ProcessGroupIslands).
#include <torch/csrc/utils/pybind.h>

#include "torch/islands/islands.h"

namespace py = pybind11;
using pycomm_torch::IslandEngines;
using pycomm_torch::ProcessGroupIslands;
using pycomm_torch::ProcessGroupPycomm;

namespace {

c10::intrusive_ptr<c10d::Backend> engine(const py::object& obj) {
  if (obj.is_none()) return {};
  return obj.cast<c10::intrusive_ptr<c10d::Backend>>();
}

c10::intrusive_ptr<ProcessGroupIslands> create(const c10::intrusive_ptr<c10d::Store>& store,
                                               int rank, int size, double timeout_s,
                                               const std::vector<int>& island_of,
                                               c10::intrusive_ptr<ProcessGroupPycomm> local,
                                               const py::object& world, const py::object& shard,
                                               const py::object& leaders) {
  IslandEngines engines{engine(world), engine(shard), engine(leaders)};
  auto ms = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000.0));
  py::gil_scoped_release nogil;
  return c10::make_intrusive<ProcessGroupIslands>(store, rank, size, ms, island_of,
                                                  std::move(local), std::move(engines));
}

}  // namespace

void register_islands(py::module_& m) {
  py::class_<ProcessGroupIslands, c10d::Backend, c10::intrusive_ptr<ProcessGroupIslands>>(
      m, "ProcessGroupIslands")
      .def(py::init(&create), py::arg("store"), py::arg("rank"), py::arg("size"),
           py::arg("timeout_s"), py::arg("island_of"), py::arg("local"), py::arg("world"),
           py::arg("shard"), py::arg("leaders"),
           "A group over several islands: `local` (a ProcessGroupPycomm of this rank's "
           "island) inside, the gloo engines between them (see pycomm/islands.py).")
      .def_property_readonly("inter_island_bytes", &ProcessGroupIslands::inter_island_bytes,
                             "Payload bytes this rank handed to the inter-island engine.")
      .def("reset_inter_island_bytes", &ProcessGroupIslands::reset_inter_island_bytes)
      .def_property_readonly("island", &ProcessGroupIslands::island)
      .def_property_readonly("local_rank", &ProcessGroupIslands::local_rank)
      .def_property_readonly(
          "islands", [](const ProcessGroupIslands& pg) { return pg.layout().members; },
          "The global ranks of each island.");
}
