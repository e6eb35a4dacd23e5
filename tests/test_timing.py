"""spinfer.timing on the CPU: medians of host-clock calls, and rounds_of and least_of_rounds (interleaved rounds), which the policy's
autotune and `spinfer bench policy` compare kernels with."""

import torch

import spinfer.timing as timing


def test_median_time_on_cpu_counts_the_calls_and_is_positive():
    calls = []
    t = timing.median_time(lambda: calls.append(1), torch.device("cpu"), reps=7, warmup=2)
    assert len(calls) == 9 and t > 0


def test_least_of_rounds_interleaves_and_keeps_the_undisturbed_rounds(monkeypatch):
    """Each call's least median over the rounds, measured a, b, a, b, ...: a stretch of slow
    time (here the first two medians, 50x) lands on single rounds and does not decide."""
    order, clock = [], iter([5.0, 5.0, 0.1, 0.3, 0.2, 0.25])

    def fake_median(fn, device, **kwargs):
        order.append(fn())
        assert kwargs == {"reps": 10}
        return next(clock)

    monkeypatch.setattr(timing, "median_time", fake_median)
    times = timing.least_of_rounds({"a": lambda: "a", "b": lambda: "b"}, torch.device("cpu"), reps=10)
    assert order == ["a", "b"] * timing.ROUNDS
    assert times == {"a": 0.1, "b": 0.25}


def test_least_of_rounds_with_one_round_is_one_median_each():
    calls = []
    times = timing.least_of_rounds({"x": lambda: calls.append("x"), "y": lambda: calls.append("y")},
                                   torch.device("cpu"), rounds=1, reps=3, warmup=1)
    assert calls == ["x"] * 4 + ["y"] * 4  # warm-up and reps of one median, then the next
    assert set(times) == {"x", "y"} and all(t > 0 for t in times.values())


def test_least_of_rounds_shuffles_rounds_after_the_first(monkeypatch):
    """shuffle=True: round 0 in the given order, round r > 0 in random.Random(r)'s order, so no
    call keeps one place (or one neighbour) in every round."""
    import random

    order = []
    monkeypatch.setattr(timing, "median_time", lambda fn, device, **kw: order.append(fn()) or 1.0)
    names = ["a", "b", "c", "d"]
    timing.least_of_rounds({n: (lambda n=n: n) for n in names}, torch.device("cpu"), rounds=3, shuffle=True)
    want = names[:]
    for r in (1, 2):
        shuffled = names[:]
        random.Random(r).shuffle(shuffled)
        want += shuffled
    assert order == want and order[4:8] != names


def test_rounds_of_times_every_call_in_every_round():
    """Each call runs twice a round with warmup=1, reps=1 (one untimed call, one timed), in rounds
    of a shuffled order; each gets one time a round, and bench e2e takes their median (as here)."""
    import statistics
    import time as _time

    calls, naps = [], {"a": 0.001, "b": 0.02, "c": 0.0}
    runs = {k: (lambda k=k: (calls.append(k), _time.sleep(naps[k]))) for k in naps}
    rounds = timing.rounds_of(runs, torch.device("cpu"), rounds=3, shuffle=True, reps=1, warmup=1,
                              flush_l2=False, max_seconds=None)
    assert all(len(ts) == 3 for ts in rounds.values())
    secs = {k: statistics.median(ts) for k, ts in rounds.items()}
    assert sorted(calls) == sorted(list(naps) * 6)
    assert secs["b"] >= 0.02 and 0.001 <= secs["a"] < secs["b"] and secs["c"] < secs["a"]
