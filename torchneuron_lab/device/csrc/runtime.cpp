// Unity translation unit for the runtime: one concern per included file, compiled once (keeps the
// build to two translation units on small machines). kernels.cpp is the other unit.
#include "config.cpp"
#include "guard.cpp"
#include "allocator.cpp"
#include "generator.cpp"
#include "hooks.cpp"
#include "recorder.cpp"
#include "profiler.cpp"
#include "bindings.cpp"
