// The Python frames of a host stack, as the recorder keys them (no torch headers: pyframes.cpp includes
// CPython's internal headers on its own).
#pragma once

#include <cstddef>

typedef struct _ts PyThreadState;

namespace tnl {

struct StackFrameRef {
  void* code;  // PyCodeObject*, a strong reference held by the stack table
  int lasti;   // instruction offset in bytes
};

// Writes the innermost `max` complete frames of `ts` (the calling thread's state, GIL held) to `out`,
// innermost first; returns how many. The frames and offsets are those PyThreadState_GetFrame /
// PyFrame_GetBack / PyFrame_GetLasti give, without making a frame object for each (pyframes.cpp).
size_t python_frames(PyThreadState* ts, StackFrameRef* out, size_t max);

}  // namespace tnl
