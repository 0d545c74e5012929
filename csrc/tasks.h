// Tasks shared out over OpenMP threads, or run on the calling thread without entering OpenMP at all. A parallel
// region that its if clause keeps to one thread still costs about 0.35 us on a Zen 4 (GOMP starts a team of one):
// a decode step's layer entered five to seven such regions around its norms, rope and attention, and each routed
// expert three more (its matmuls run one expert per thread).
#pragma once

#include <cstdint>

namespace offload {

// work(state, i) for i in [0, n), state = setup() once per thread: over nth threads (dynamic, one task at a time)
// where parallel and nth > 1, else in order on the calling thread.
template <class Setup, class Work>
void run_tasks(int nth, bool parallel, int64_t n, Setup&& setup, Work&& work) {
  if (!parallel || nth <= 1 || n <= 1) {
    auto state = setup();
    for (int64_t i = 0; i < n; ++i) work(state, i);
    return;
  }
#pragma omp parallel num_threads(nth)
  {
    auto state = setup();
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) work(state, i);
  }
}

// work(i) for i in [0, n): run_tasks without per-thread state.
template <class Work>
void run_tasks(int nth, bool parallel, int64_t n, Work&& work) {
  run_tasks(nth, parallel, n, [] { return 0; }, [&](int, int64_t i) { work(i); });
}

}  // namespace offload
