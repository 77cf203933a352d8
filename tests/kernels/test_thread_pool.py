"""The kernels' thread pool: every task of a parallel_for runs exactly once, whatever the split of
tasks over threads (each thread's own range, then stealing from the back of the others'), and a
task's exception reaches the caller without losing the other tasks."""
import pytest

from ktransformers import cpuinfer_ext as ext


@pytest.mark.parametrize("threads", [2, 3, 5])
@pytest.mark.parametrize("ntasks", [0, 1, 2, 3, 7, 64, 1001])
def test_each_task_runs_once(threads, ntasks):
    reps = 20
    runs, by_thread, err = ext._pool_task_counts(threads, ntasks, reps)
    assert err == ""
    assert runs == [reps] * ntasks
    assert sum(by_thread) == reps * ntasks


def test_all_threads_take_part():
    # 1001 tasks of up to 6 us each: the calling thread cannot finish them all before the
    # others wake up (they spin between calls), so every thread runs some
    _, by_thread, _ = ext._pool_task_counts(2, 1001, 20)
    assert min(by_thread) > 0


def test_exception_reaches_the_caller():
    runs, _, err = ext._pool_task_counts(3, 50, 4, throw_at=17)
    assert err == "task 17"
    assert runs == [4] * 50  # the other tasks of each call still ran
