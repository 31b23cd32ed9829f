// The process group behind the op's sequence_parallel name (csrc/ulysses.h).
#include "ulysses.h"

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include <exception>

namespace ckpt_ext {
namespace ulysses {

Group resolve(c10::string_view name, const char* op) {
  Group g;
  g.name = std::string(name);
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  try {
    pg = c10d::resolve_process_group(g.name);
  } catch (const std::exception& e) {
    CKPT_CHECK_VALUE(false, op, "sequence_parallel='", g.name,
                     "' is not a registered process group name (pass group.group_name of a "
                     "torch.distributed group): ", e.what());
  }
  g.rank = pg->getRank();
  g.size = pg->getSize();
  return g;
}

}  // namespace ulysses
}  // namespace ckpt_ext
