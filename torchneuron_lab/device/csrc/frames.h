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

// Writes the innermost `max` complete frames of `ts` (the calling thread's state; GIL held, or see below) to `out`,
// innermost first; returns how many. The frames and offsets are those PyThreadState_GetFrame /
// PyFrame_GetBack / PyFrame_GetLasti give, without making a frame object for each (pyframes.cpp).
size_t python_frames(PyThreadState* ts, StackFrameRef* out, size_t max);

// Whether python_frames may read the calling thread's own frames without the GIL: on 3.11 it reads the
// interpreter's records, which only the thread itself changes, and only while it runs Python (never while
// it is inside a C call); the public API of other versions makes frame objects and needs the GIL.
bool python_frames_without_gil();

}  // namespace tnl
