// Unity translation unit for the runtime: one concern per included file, compiled once (keeps the
// build to two translation units on small machines). kernels.cpp is the other unit.
// Kineto's inline activity methods format with fmt; torch does not export fmt, so compile it in.
#define FMT_HEADER_ONLY 1
#include "config.cpp"
#include "queue.cpp"
#include "guard.cpp"
#include "allocator.cpp"
#include "generator.cpp"
#include "hooks.cpp"
#include "serialization.cpp"
#include "recorder.cpp"
#include "profiler.cpp"
#include "bindings.cpp"
#include "graphs.cpp"
#include "collectives.cpp"
#include "cuda_parity.cpp"
#include "layouts.cpp"
