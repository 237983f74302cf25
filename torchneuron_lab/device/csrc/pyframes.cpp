// Walking the host's Python stack for launch sites and recorded stacks, without making frame objects.
//
// CPython 3.11 keeps a call's frame in an internal record and creates its frame object only when asked
// for one: PyThreadState_GetFrame and PyFrame_GetBack create one for every frame they pass that has none
// yet. A launch captures its site (up to kLaunchSiteDepth frames) at every op, and a model's forward
// makes new Python frames at every call, so the public walk allocated a frame object per new frame per
// launch (perf: 7.2% of the launching thread's samples for relu called through three fresh functions,
// 33 frames deep; 2.3% with this walk). On 3.11 the interpreter's records are read directly: the same frames the
// public functions return (incomplete frames skipped, as they skip them) and the same byte offsets
// PyFrame_GetLasti gives. Other versions take the public API (3.12 and later: not built against here).
#include <patchlevel.h>
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
#define TNL_INTERNAL_FRAMES 1
#define Py_BUILD_CORE 1
#endif
#include <Python.h>
#ifdef TNL_INTERNAL_FRAMES
#include <internal/pycore_frame.h>
#else
#include <frameobject.h>
#endif

#include "frames.h"

namespace tnl {

size_t python_frames(PyThreadState* ts, StackFrameRef* out, size_t max) {
  size_t n = 0;
#ifdef TNL_INTERNAL_FRAMES
  for (_PyInterpreterFrame* f = ts->cframe->current_frame; f != nullptr && n < max; f = f->previous) {
    if (_PyFrame_IsIncomplete(f)) continue;
    const int units = _PyInterpreterFrame_LASTI(f);
    out[n++] = {f->f_code, units < 0 ? -1 : units * static_cast<int>(sizeof(_Py_CODEUNIT))};
  }
#else
  PyFrameObject* f = PyThreadState_GetFrame(ts);  // new reference or NULL
  while (f != nullptr && n < max) {
    PyCodeObject* code = PyFrame_GetCode(f);  // new reference; the live frame keeps the code alive
#if PY_VERSION_HEX >= 0x030B0000
    const int lasti = PyFrame_GetLasti(f);
#else
    const int lasti = f->f_lasti * 2;
#endif
    out[n++] = {code, lasti};
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(f);
    Py_DECREF(f);
    f = back;
  }
  Py_XDECREF(f);
#endif
  return n;
}

bool python_frames_without_gil() {
#ifdef TNL_INTERNAL_FRAMES
  return true;
#else
  return false;
#endif
}

}  // namespace tnl
